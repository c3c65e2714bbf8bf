"""Check the measured numbers in README.md and docs/SUPPORT.md against the result files they come from.

    python scripts/check_claims.py [--root DIR]

The claims are listed in bench/results/claims.toml, one `[[claim]]` each:

    [[claim]]
    doc = "README.md"                          # where the claim is written
    text = "1.31x native Megatron"             # a passage of it (whitespace, ** and backticks aside;
                                               # its measured numbers are read from the document)
    file = "graphed_slice_h100_qwen3.json"     # its evidence, under bench/results/
    values = ["{a.b} / {a.c}"]                 # one expression per measured number in `text`

A claim that compares two files names them: `file = { a = "x.json", b = "y.json" }`, and its
expressions read `{a:path}`, `{b:path}`.

A measured number is a number with a unit (x, %, ms, us, s, MiB, GiB, GB/s, TFLOP/s), a test
count (N passed / failed / skipped, N/N, N of N) or any other decimal (1.5, 2.3e-2; not a version
such as 0.6.5); a range `a-b` or a pair `a / b` is one number each. Each expression reads the
JSON: `{path}` is the value at a dotted path (list indices are numbers, a key with dots is
quoted: `'a.py'`, `run=x` is the list item whose `run` is x; `*` takes every key or item: a list
of values, on which arithmetic applies to each, which can be sliced), with `min`, `max`, `abs`,
`sum`, `len` and arithmetic. The written number must equal its value rounded to the decimals
written (to the significant digits written, in scientific notation).

Every measured number in the two documents must be inside some claim's text, or inside a
`[[not_measured]]` entry's text (a default, a limit or a setting, not a measurement). Exit status
1 lists each number that differs from its evidence, each passage not found, and each number that
no claim covers; 0 prints a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass

DOCS = ("README.md", "docs/SUPPORT.md")
CLAIMS = "bench/results/claims.toml"
_NUM = r"\d+(?:\.\d+)?"
_SEP = r"\s?(?:-|/|vs|against)\s?"
_UNIT = r"(?:x\b|\s?%|\s?ms\b|\s?us\b|\s[sS]\b|\s?MiB\b|\s?GiB\b|\s?GB/s|\s?TFLOP/s|\s(?:passed|failed|skipped)\b)"
_DECIMAL = r"\d+\.\d+(?:e-\d+)?"
#: A measured number: numbers joined by range or pair separators, then a unit; N/N, N of N counts;
#: any other decimal (a version has two dots and is not one).
MEASURED = re.compile(
    rf"(?<![\w.]){_NUM}(?:{_SEP}{_NUM})*{_UNIT}|(?<![\w./])\d+(?:/| of )\d+(?![\w./])"
    rf"|(?<![\w./-]){_DECIMAL}(?:{_SEP}{_DECIMAL})*(?![\w.])"
)
_FIELD = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class Claim:
    doc: str
    text: str
    file: str | dict[str, str]
    values: tuple[str, ...]


def numbers_in(text: str) -> list[str]:
    """The measured numbers of `text`, each as written, in order."""
    return [n for m in MEASURED.finditer(text) for n in re.findall(rf"{_DECIMAL}|{_NUM}", m.group(0))]


class Values(list):
    """The values a `*` path fans out to: arithmetic applies to each (two of them pair up)."""

    def _map(self, other, op):
        pairs = zip(self, other, strict=True) if isinstance(other, list) else ((v, other) for v in self)
        return Values(op(a, b) for a, b in pairs)

    def __add__(self, other):
        return self._map(other, lambda a, b: a + b)

    def __sub__(self, other):
        return self._map(other, lambda a, b: a - b)

    def __mul__(self, other):
        return self._map(other, lambda a, b: a * b)

    def __truediv__(self, other):
        return self._map(other, lambda a, b: a / b)

    def __rsub__(self, other):
        return self._map(other, lambda a, b: b - a)

    def __rtruediv__(self, other):
        return self._map(other, lambda a, b: b / a)

    __radd__, __rmul__ = __add__, __mul__


def _lookup(data, path: str):
    """The value at a dotted `path` of `data`: a key, a list index, `*` (every item: `Values`), or
    `field=value` (the list item whose field is value)."""
    values = [data]
    fanned = False
    for part in re.findall(r"'[^']*'|[^.]+", path):
        part = part.strip("'")
        nxt = []
        for v in values:
            if part == "*":
                nxt.extend(v.values() if isinstance(v, dict) else v)
                fanned = True
            elif "=" in part:
                name, _, want = part.partition("=")
                found = [item for item in v if str(item.get(name)) == want]
                if len(found) != 1:
                    raise KeyError(f"{len(found)} items with {part}")
                nxt.append(found[0])
            elif isinstance(v, list):
                nxt.append(v[int(part)])
            else:
                nxt.append(v[part])
        values = nxt
    return Values(values) if fanned else values[0]


def evaluate(expression: str, data) -> float:
    """An expression of `{path}` fields over the JSON `data` (`{name:path}` where `data` is a
    dict of named files)."""
    names = {}

    def field(m):
        name, _, path = m.group(1).strip().rpartition(":")
        names[f"_v{len(names)}"] = _lookup(data[name] if name else data, path)
        return f"_v{len(names) - 1}"

    code = _FIELD.sub(field, expression)
    allowed = {"min": min, "max": max, "abs": abs, "sum": sum, "len": len, "round": round}
    return float(eval(code, {"__builtins__": {}}, {**allowed, **names}))  # noqa: S307 - the repo's own table


def matches(written: str, value: float) -> bool:
    if "e-" in written:  # as many significant digits as written
        mantissa, _, exponent = written.partition("e-")
        return matches(mantissa, value * 10 ** int(exponent))
    decimals = len(written.partition(".")[2])
    return math.isclose(round(value, decimals), float(written), abs_tol=10 ** -(decimals + 6))


def passage_pattern(text: str) -> re.Pattern:
    """`text` as a pattern in which each measured number may be any number (so a changed number
    is found, and reported against its evidence)."""
    parts, last = [], 0
    for m in MEASURED.finditer(text):
        parts.append(re.escape(text[last : m.start()]))
        parts.append(re.sub(re.escape("NUMBER"), lambda _: _NUM, re.escape(re.sub(_NUM, "NUMBER", m.group(0)))))
        last = m.end()
    parts.append(re.escape(text[last:]))
    return re.compile("".join(parts))


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("**", "").replace("`", ""))


def load(root: str):
    with open(os.path.join(root, CLAIMS), "rb") as f:
        table = tomllib.load(f)
    claims = [Claim(c["doc"], c["text"], c["file"], tuple(c["values"])) for c in table.get("claim", [])]
    exempt = [(e["doc"], e["text"]) for e in table.get("not_measured", [])]
    return claims, exempt


def _read(root: str, file: str | dict[str, str]):
    if isinstance(file, dict):
        return {name: _read(root, one) for name, one in file.items()}
    with open(os.path.join(root, "bench", "results", file), encoding="utf-8") as f:
        return json.load(f)


def check(root: str) -> tuple[list[str], str]:
    """(problems, summary) of the claims under `root`."""
    claims, exempt = load(root)
    docs = {}
    for doc in DOCS:
        with open(os.path.join(root, doc), encoding="utf-8") as f:
            docs[doc] = _squash(f.read())
    problems = []
    covered = {doc: [] for doc in DOCS}  # (start, end) spans of claims and exemptions
    for claim in claims:
        where = f"{claim.doc}: {claim.text[:60]!r}"
        found = passage_pattern(_squash(claim.text)).search(docs[claim.doc])
        if found is None:
            problems.append(f"{where}: passage not found")
            continue
        covered[claim.doc].append(found.span())
        written = numbers_in(found.group(0))
        if len(written) != len(claim.values):
            problems.append(f"{where}: {len(written)} measured numbers {written}, {len(claim.values)} values")
            continue
        try:
            data = _read(root, claim.file)
        except (OSError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        for number, expression in zip(written, claim.values):
            try:
                value = evaluate(expression, data)
            except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
                problems.append(f"{where}: {expression}: {type(exc).__name__}: {exc}")
                continue
            if not matches(number, value):
                problems.append(f"{where}: written {number}, the file gives {value:.6g} ({expression})")
    for doc, text in exempt:  # every occurrence
        spans = [m.span() for m in re.finditer(re.escape(_squash(text)), docs[doc])]
        if not spans:
            problems.append(f"{doc}: not_measured passage not found: {text[:60]!r}")
        covered[doc].extend(spans)
    uncovered = 0
    for doc, text in docs.items():
        for m in MEASURED.finditer(text):
            if not any(a <= m.start() and m.end() <= b for a, b in covered[doc]):
                uncovered += 1
                context = text[max(m.start() - 40, 0) : m.end() + 20]
                problems.append(f"{doc}: {m.group(0)!r} is in no claim: ...{context}...")
    summary = f"{len(claims)} claims checked against bench/results, {len(exempt)} passages not measured"
    return problems, summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = parser.parse_args(argv)
    problems, summary = check(args.root)
    print("\n".join(problems + [summary]))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
