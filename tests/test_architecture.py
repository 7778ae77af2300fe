"""The layout's rules (docs/architecture.md), checked on the source tree itself.

Every import counts, also one inside a function: `from pkg import mod` imports `pkg` (its
`__init__` runs), `from pkg.mod import name` and `import pkg.mod as m` import `pkg.mod`.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "shardloader"

#: Bottom to top. A package may import its own modules and any package on a lower floor,
#: never one on its own floor or above. Top-level modules count as packages of their own
#: ("<api>" is shardloader/__init__.py).
FLOORS: list[set[str]] = [
    {"errors", "units", "_version"},
    {"io", "runtime", "order", "synthetic"},
    {"format", "transforms", "telemetry"},
    {"cache"},
    {"source"},
    {"dataset", "checkpoint"},
    {"loader", "ingest"},
    {"<api>", "spark", "ray"},
    {"cli"},
]
MAX_LINES = 500


def _modules() -> dict[str, Path | None]:
    """Dotted module name -> file (None for a C extension, known by its source)."""
    found: dict[str, Path | None] = {}
    for path in (SRC / PACKAGE).rglob("*"):
        if path.suffix not in (".py", ".c"):
            continue
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path if path.suffix == ".py" else None
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module `name` lives in (itself, or the closest parent that is a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(t for a in node.names if (t := _owner(a.name)) and a.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not name.startswith(PACKAGE):
                continue
            parent = _owner(name)
            for alias in node.names:
                full = f"{name}.{alias.name}"
                if full in MODULES:
                    out.add(full)
                    if MODULES[parent] is not None and MODULES[parent].name == "__init__.py":
                        out.add(parent)  # `from pkg import mod` runs pkg/__init__.py
                elif parent:
                    out.add(parent)
    out.discard(module)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items() if p is not None}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<api>"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def test_no_import_circle_between_modules():
    assert _cycles(GRAPH) == []


def test_no_import_circle_between_packages():
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        packages[_package(module)].update(_package(t) for t in targets if _package(t) != _package(module))
    assert _cycles(packages) == []


def test_imports_only_point_down():
    floor = {package: level for level, packages in enumerate(FLOORS) for package in packages}
    missing = sorted({_package(m) for m in MODULES} - set(floor))
    assert missing == [], f"packages without a floor in FLOORS (add them, and to docs/architecture.md): {missing}"
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if _package(target) != _package(module) and floor[_package(target)] >= floor[_package(module)]
    )
    assert upward == []


def test_no_file_over_the_line_limit():
    long = {str(p.relative_to(SRC)): n for p in (SRC / PACKAGE).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_loader_reads_sources_only_through_their_protocol():
    """loader/ imports no concrete source, cache or dataset, and never probes what it is given
    with `getattr`/`hasattr`/`isinstance` of a source class."""
    allowed = {"shardloader.source.protocol"}
    reached = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items() if _package(module) == "loader"
        for target in targets
        if _package(target) in ("source", "cache", "dataset") and target not in allowed
    )
    assert reached == []
    probes = []
    for module, path in MODULES.items():
        if path is None or _package(module) != "loader":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                subject = ast.unparse(node.args[0])
                if re.search(r"\b(_?data|dataset|source)\b", subject):
                    probes.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert probes == []


def test_fsspec_clients_are_built_in_one_place():
    """Every URL is opened through `shardloader.io.clients` (pooling, fork care, retries)."""
    factory = SRC / PACKAGE / "io" / "clients.py"
    sites = []
    for path in (SRC / PACKAGE).rglob("*.py"):
        if path == factory:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\b(url_to_fs|fsspec\.filesystem|fsspec\.open)\s*\(", code):
                sites.append(f"{path.relative_to(SRC)}:{lineno}")
    assert sites == []
