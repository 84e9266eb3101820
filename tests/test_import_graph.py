"""The import graph of router/ and procman/: no circle, and the allowed edges between packages.

Every import counts — module level, inside functions, under ``if TYPE_CHECKING:``, relative or
absolute — because a circle closed through type-only imports is still a circle a reader has to
hold in their head (and one ``from __future__`` removal away from an ImportError).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "procman", "modelserver")
CHECKED = ("router", "procman")
#: What the router may import of modelserver: the settings schema and the model-file helpers, never the server.
ROUTER_MAY_IMPORT = {"modelserver.spec", "modelserver.modelfiles", "modelserver.modelinfo", "modelserver.surrogates"}
#: The router's sub-packages in import order: each may import those before it, never those after it.
LAYERS = ("router.edge", "router.state", "router.path", "router.api")


def modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _owner(name: str, known: Mapping[str, Path]) -> str | None:
    """The module of ours that ``name`` (a module, or a name inside one) lives in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """Every module of ours that ``module`` imports, anywhere in its file."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target, known)
            if owner is not None and owner != module:
                found.add(owner)
    return found


def graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(edges: Mapping[str, set[str]]) -> list[str] | None:
    """One import circle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_circle() -> None:
    edges = graph()
    ours = {m for m in edges if m.split(".")[0] in CHECKED}
    checked = {m: edges[m] & ours for m in ours}
    cycle = find_cycle(checked)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_procman_imports_neither_router_nor_modelserver() -> None:
    edges = graph()
    bad = sorted(f"{m} -> {t}" for m, out in edges.items() if _in(m, "procman")
                 for t in out if _in(t, "router") or _in(t, "modelserver"))
    assert not bad, bad


def test_router_imports_only_the_schema_of_modelserver() -> None:
    edges = graph()
    bad = sorted(f"{m} -> {t}" for m, out in edges.items() if _in(m, "router")
                 for t in out if _in(t, "modelserver") and t not in ROUTER_MAY_IMPORT)
    assert not bad, bad


def test_router_packages_import_one_way() -> None:
    edges = graph()
    bad = []
    for module, out in edges.items():
        mine = next((i for i, layer in enumerate(LAYERS) if _in(module, layer)), None)
        if mine is None:
            continue
        for target in out:
            theirs = next((i for i, layer in enumerate(LAYERS) if _in(target, layer)), None)
            if theirs is not None and theirs > mine:
                bad.append(f"{module} -> {target}")
    assert not bad, f"an import goes up {' <- '.join(LAYERS)}: {sorted(bad)}"


def test_a_circle_is_found(tmp_path: Path) -> None:
    """The checker itself: a type-only import that closes a circle, a relative one, one inside a function."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (package / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                          "if TYPE_CHECKING:\n    from pkg.a import x\n")
    edges = graph(tmp_path, ["pkg"])
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.sub.c"} and edges["pkg.sub.c"] == {"pkg.a"}
    assert find_cycle(edges) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (package / "sub" / "c.py").write_text("import pkg\n")
    assert find_cycle(graph(tmp_path, ["pkg"])) is None
