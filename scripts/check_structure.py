"""Measure the package's structure from its imports (issue 38).

    python scripts/check_structure.py [PACKAGE_DIR]

PACKAGE_DIR defaults to megatron_moe_ext/ beside this script's folder. Every `import` and
`from ... import` of the package's own modules counts, relative or absolute, at module level
or inside a function. Four measures:

- circles: import circles between modules, and between folders (a folder is the package
  directory of a module: dispatcher/flex.py is in dispatcher/, config.py in the top folder;
  folder A -> folder B when a module of A imports a module of B). Each circle is printed,
  with the import that makes each of its steps.
- underscore imports: another module's underscore name used inside the package, imported
  (`from x import _name`) or read off an imported module (`x._name`).
- long modules: modules above MAX_LINES lines (a warning).
- experts depth: the longest chain of imports among the modules of experts/ (its subfolders
  included), counted in imports; above MAX_EXPERTS_DEPTH is a warning.

Circles and underscore imports are violations: exit status 1, with the list. Sizes and depths
are caps to watch, not rules: a module past them is printed as a warning, exit status 0. A
one-line summary ends every report. What
counts as an edge: `from a.b import c` is an import of module a.b.c where that is a module of
the package, else of a.b; the parent packages' `__init__` that Python also runs are not
counted (every module would be in a circle with its package's `__init__`), nor are
`importlib.import_module` calls.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass

MAX_LINES = 450
MAX_EXPERTS_DEPTH = 6
MAX_CIRCLES = 200  # elementary circles listed per graph at the most


@dataclass(frozen=True)
class Import:
    """One import of a package module: who imports, what, and where."""

    source: str  # dotted module name of the importing module
    target: str  # dotted module name of the imported module
    path: str  # importing file, relative to the package's parent folder
    line: int


@dataclass(frozen=True)
class UnderscoreUse:
    """`from target import _name` or `target._name` in another module."""

    path: str
    line: int
    target: str
    name: str


@dataclass
class Package:
    """A package's modules (dotted name -> file) and the imports among them."""

    root: str  # the package folder
    files: dict  # module name -> absolute path
    imports: list  # [Import]
    underscore: list  # [UnderscoreUse]

    def rel(self, module):
        return os.path.relpath(self.files[module], os.path.dirname(self.root))


def module_names(root):
    """Dotted module name -> file for every .py file under the package folder `root`."""
    base = os.path.basename(os.path.normpath(root))
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        parts = [base] + [p for p in os.path.relpath(folder, root).split(os.sep) if p != "."]
        for name in sorted(names):
            if name.endswith(".py"):
                stem = name[:-3]
                files[".".join(parts if stem == "__init__" else parts + [stem])] = os.path.join(folder, name)
    return files


def folder_of(module, files):
    """The package directory of a module, as a dotted name (a package is in its own folder)."""
    return module if files[module].endswith("__init__.py") else module.rpartition(".")[0]


def _resolve(module, is_package, level, name):
    """The absolute dotted name of `from <level dots><name> import ...` written in `module`."""
    if not level:
        return name
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def read_package(root):
    """Parse every module under `root`; return its imports of package modules and underscore uses."""
    root = os.path.abspath(root)
    files = module_names(root)
    pkg = Package(root, files, [], [])
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        rel = pkg.rel(module)
        aliases = {}  # local name -> package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in files:
                        pkg.imports.append(Import(module, alias.name, rel, node.lineno))
                        if alias.asname:
                            aliases[alias.asname] = alias.name
                    head = alias.name.partition(".")[0]
                    if not alias.asname and head in files:
                        aliases[head] = head
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path.endswith("__init__.py"), node.level, node.module)
                if base not in files:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in files else base
                    pkg.imports.append(Import(module, target, rel, node.lineno))
                    if sub in files:
                        aliases[alias.asname or alias.name] = sub
                    if _private(alias.name):
                        pkg.underscore.append(UnderscoreUse(rel, node.lineno, base, alias.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = _dotted(node.value, aliases)
                if target in files and target != module:
                    pkg.underscore.append(UnderscoreUse(rel, node.lineno, target, node.attr))
    pkg.imports = sorted(set(i for i in pkg.imports if i.source != i.target), key=lambda i: (i.path, i.line))
    pkg.underscore.sort(key=lambda u: (u.path, u.line))
    return pkg


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _dotted(node, aliases):
    """`a.b.c` as a dotted module name, its head mapped through the import aliases; else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id]] + parts[::-1])


def graph(edges):
    """{node: sorted successors} from (a, b) pairs."""
    out = {}
    for a, b in edges:
        out.setdefault(a, set()).add(b)
        out.setdefault(b, set())
    return {n: sorted(s) for n, s in out.items()}


def circles(succ, limit=MAX_CIRCLES):
    """The elementary circles of a directed graph, each as [n0, n1, ..., n0], smallest node first."""
    found = []
    nodes = sorted(succ)
    for i, start in enumerate(nodes):
        allowed = set(nodes[i:])
        stack = [(start, iter(succ[start]))]
        on_path = [start]
        while stack and len(found) < limit:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                on_path.pop()
            elif nxt == start:
                found.append(on_path + [start])
            elif nxt in allowed and nxt not in on_path:
                stack.append((nxt, iter(succ[nxt])))
                on_path.append(nxt)
    return sorted(found, key=lambda c: (len(c), c))


def longest_chain(succ):
    """The longest chain of imports (a path without repeats) in a small graph."""
    best = []

    def walk(path):
        nonlocal best
        if len(path) > len(best):
            best = list(path)
        for nxt in succ[path[-1]]:
            if nxt not in path:
                walk(path + [nxt])

    for node in sorted(succ):
        walk([node])
    return best


def measure(root):
    """All four measures of the package under `root`, as a dict."""
    pkg = read_package(root)
    files = pkg.files
    by_edge = {}  # (module or folder, module or folder) -> [Import]
    for imp in pkg.imports:
        by_edge.setdefault((imp.source, imp.target), []).append(imp)
        pair = (folder_of(imp.source, files), folder_of(imp.target, files))
        if pair[0] != pair[1]:
            by_edge.setdefault(pair, []).append(imp)
    module_edges = [(i.source, i.target) for i in pkg.imports]
    folder_edges = [(folder_of(a, files), folder_of(b, files)) for a, b in module_edges]
    folder_edges = [(a, b) for a, b in folder_edges if a != b]
    experts = f"{os.path.basename(pkg.root)}.experts"
    expert_edges = [(a, b) for a, b in module_edges if _within(a, experts) and _within(b, experts)]
    lengths = {m: _count_lines(p) for m, p in files.items()}
    return {
        "modules": len(files),
        "module_circles": [_witness(c, by_edge) for c in circles(graph(module_edges))],
        "folder_circles": [_witness(c, by_edge) for c in circles(graph(folder_edges))],
        "underscore": pkg.underscore,
        "long_modules": sorted((pkg.rel(m), n) for m, n in lengths.items() if n > MAX_LINES),
        "experts_chain": longest_chain(graph(expert_edges)) if expert_edges else [],
    }


def _within(module, package):
    return module == package or module.startswith(package + ".")


def _count_lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def _witness(circle, by_edge):
    """A circle with, for each step, the imports that make it: [(a, b, [Import])]."""
    return [(a, b, by_edge[(a, b)]) for a, b in zip(circle, circle[1:])]


def report(m):
    """(violation lines, warning lines, one-line summary) of `measure`'s result."""
    depth = max(len(m["experts_chain"]) - 1, 0)
    lines = []
    for kind in ("module", "folder"):
        for circle in m[f"{kind}_circles"]:
            lines.append(f"{kind} circle: " + " -> ".join(_short(c[0]) for c in circle + circle[:1]))
            lines += [f"    {_short(a)} -> {_short(b)}: " + _places(imps) for a, b, imps in circle]
    lines += [f"underscore import: {u.path}:{u.line} {u.target}.{u.name}" for u in m["underscore"]]
    warnings = [f"warning: long module: {p} ({n} lines > {MAX_LINES})" for p, n in m["long_modules"]]
    chain = " -> ".join(map(_short, m["experts_chain"])) or "no imports"
    if depth > MAX_EXPERTS_DEPTH:
        warnings.append(f"warning: experts depth {depth} > {MAX_EXPERTS_DEPTH}: {chain}")
    summary = (
        f"{m['modules']} modules: {len(m['module_circles'])} module circles, "
        f"{len(m['folder_circles'])} folder circles, {len(m['underscore'])} underscore imports, "
        f"{len(m['long_modules'])} modules > {MAX_LINES} lines, experts depth {depth} "
        f"(limit {MAX_EXPERTS_DEPTH}: {chain})"
    )
    return lines, warnings, summary


def _short(module):
    """A module's name without the package's own name (the package itself keeps it)."""
    return module.partition(".")[2] or module


def _places(imports, most=3):
    places = list(dict.fromkeys(f"{i.path}:{i.line}" for i in imports))
    more = f" (+{len(places) - most} more)" if len(places) > most else ""
    return ", ".join(places[:most]) + more


def main(argv):
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = argv[0] if argv else os.path.join(here, "megatron_moe_ext")
    lines, warnings, summary = report(measure(root))
    print("\n".join(lines + warnings + [summary]))
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
