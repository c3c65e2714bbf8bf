"""Check that every public name of the seed API pages keeps its signature in this package.

    python scripts/check_seed_signatures.py [--strict] [SEED_DIR]

SEED_DIR holds the seed pages (Markdown; default: the first of ../shared/seeds and
../../shared/seeds beside this checkout that exists). Each ```python block of a page is one
name: `[class ]module.Name(params) [-> type]`, or `module.Class.method(params)`. A public
name (no leading underscore in its own name or its class's) must exist here and keep the
seed's parameters: the same names in the same order and kinds, the same defaults; this
package may add a default where the seed has none, and parameters after the seed's that
have defaults. Annotations are not compared (the seed writes its own module paths).
Private names are checked the same way where the package defines them, and listed where it
does not. Exit status 1 when a checked name breaks, with one line per break.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys

# Where this package defines the seed modules' names, searched in order.
MODULES = {
    "nemo_automodel.components.moe.megatron.token_dispatcher": (
        "megatron_moe_ext.dispatcher.config",
        "megatron_moe_ext.dispatcher.flex",
        "megatron_moe_ext.dispatcher.topk_manager",
        "megatron_moe_ext.dispatcher.common.base",
        "megatron_moe_ext.dispatcher.hybridep",
        "megatron_moe_ext.dispatcher.hybridep.manager",
        "megatron_moe_ext.dispatcher.hybridep.metadata",
        "megatron_moe_ext.dispatcher.hybridep.runtime",
        "megatron_moe_ext.dispatcher.common.permute",
    ),
    "nemo_automodel.components.moe.experts": (
        "megatron_moe_ext.experts",
        "megatron_moe_ext.experts.dispatch",
        "megatron_moe_ext.experts.grouped",
        "megatron_moe_ext.experts.te",
        "megatron_moe_ext.experts.activations",
        "megatron_moe_ext.experts.bias",
        "megatron_moe_ext.experts.mlp",
        "megatron_moe_ext.experts.common",
    ),
}
# Divergences this package had before the check existed (main at b8af315), each a decision
# for the lead: the check fails on any other break. `--strict` reports these too.
KNOWN = {
    "GroupedExperts",
    "GroupedExpertsDeepEP",
    "GroupedExpertsTE",
    "GroupedExpertsTE.set_moe_mesh",
    "GroupedExpertsTE.state_dict",
    "get_expert_activation_for_deepep",
    "quick_geglu_deepep",
    "relu2_deepep",
    "swiglu_clamped_deepep",
    "swiglu_oai_deepep",
    "MoEFlexTokenDispatcher.dispatch_preprocess",
}
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_HEAD = re.compile(r"^(class\s+)?([\w.]+)\((.*)\)\s*(->.*)?$", re.S)


def _split_params(text: str) -> list[str]:
    """Top-level comma split (annotations and defaults nest brackets and strings)."""
    parts, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    return [p for p in parts + [current.strip()] if p]


def _seed_param(text: str) -> tuple[str, str | None]:
    """`name: type = default` -> `(name, default text or None)`; `*args` keeps its stars."""
    name_part, default = (text.split("=", 1) + [None])[:2] if "=" in _outside_brackets(text) else (text, None)
    return name_part.split(":", 1)[0].strip(), None if default is None else default.strip()


def _outside_brackets(text: str) -> str:
    """`text` with bracketed parts removed (a `=` inside `Literal[...]` is not a default)."""
    out, depth = "", 0
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        out += ch if depth == 0 else ""
    return out


def seed_entries(seed_dir: str):
    """`(seed module, qualified name, [(param, default text)])` of every signature block."""
    for page in sorted(os.listdir(seed_dir)):
        if not page.endswith(".md"):
            continue
        for block in _BLOCK.findall(open(os.path.join(seed_dir, page)).read()):
            head = _HEAD.match(block.strip())
            if head is None:
                continue  # a data entry (`NAME = value`)
            dotted = head.group(2)
            module = next((m for m in MODULES if dotted.startswith(m + ".")), None)
            if module is None:
                continue
            params = [_seed_param(p) for p in _split_params(head.group(3))]
            yield module, dotted[len(module) + 1 :], params


def _find(module: str, qualname: str):
    """This package's object for a seed name, or None."""
    first, *rest = qualname.split(".")
    for name in MODULES[module]:
        obj = getattr(importlib.import_module(name), first, None)
        if obj is None:
            continue
        for attr in rest:
            obj = inspect.getattr_static(obj, attr, None)
            obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
            if obj is None:
                break
        if obj is not None:
            return obj
    return None


def _ours(obj, is_method: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(obj).parameters.values())
    if is_method and params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


def compare(seed_params, params: list[inspect.Parameter]) -> str | None:
    """Why `params` do not keep `seed_params`, or None."""
    star = {"*": inspect.Parameter.VAR_POSITIONAL, "**": inspect.Parameter.VAR_KEYWORD}
    for i, (name, default) in enumerate(seed_params):
        if i >= len(params):
            return f"lost parameter {name!r}"
        ours = params[i]
        if ours.kind in star.values() and ours.name == name.lstrip("*") and default in (None, "()", "{}"):
            continue  # the pages render `*args` as `args = ()`
        stars = name[: len(name) - len(name.lstrip("*"))]
        if ours.name != name.lstrip("*"):
            return f"parameter {i} is {ours.name!r}, the seed's is {name.lstrip('*')!r}"
        if stars and ours.kind != star[stars]:
            return f"parameter {name!r} is {ours.kind.description}"
        if default is not None and (ours.default is inspect.Parameter.empty or repr(ours.default) != default):
            return f"default of {name!r} is {ours.default!r}, the seed's is {default}"
    for extra in params[len(seed_params) :]:
        if extra.default is inspect.Parameter.empty and extra.kind not in star.values():
            return f"added parameter {extra.name!r} without a default"
    return None


def main(argv: list[str]) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    strict = "--strict" in argv
    argv = [a for a in argv if a != "--strict"]
    candidates = argv[1:] or [
        os.path.join(root, "..", "shared", "seeds"),
        os.path.join(root, "..", "..", "shared", "seeds"),
    ]
    seed_dir = next((d for d in candidates if os.path.isdir(d)), None)
    if seed_dir is None:
        print(f"no seed pages in {candidates}", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    broken, checked, absent_private = [], 0, []
    for module, qualname, seed_params in seed_entries(seed_dir):
        public = not any(part.startswith("_") for part in qualname.split("."))
        obj = _find(module, qualname)
        if obj is None:
            (broken if public else absent_private).append(f"{qualname}: not defined")
            continue
        why = compare(seed_params, _ours(obj, "." in qualname))
        checked += 1
        if why is not None:
            broken.append(f"{qualname}: {why}")
    known = [line for line in broken if line.split(":")[0] in KNOWN]
    new = [line for line in broken if line not in known]
    print(
        f"{checked} seed signatures checked; {len(new)} broken; {len(known)} known divergences; "
        f"{len(absent_private)} private seed names not defined here"
    )
    for line in new + (known if strict else []):
        print("BROKEN", line)
    return 1 if new or (strict and known) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
