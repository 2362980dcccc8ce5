"""The package's architecture, checked: no import cycle, no private name imported across modules.

The import graph is read from the source with ``ast`` (every ``import`` and ``from ... import``
inside the ``l2l`` package, at module level or inside functions, since a deferred import
is still a dependency). An edge goes to the module named, or to the submodule when a
``from package import name`` names one. A parent package is not an implicit edge: a
package's ``__init__`` importing its own submodules is the normal pattern.
"""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "host" / "l2l"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(mods: dict[str, Path]) -> dict[str, set[tuple[str, str | None]]]:
    """module -> {(imported module, the name taken from it or None)} within the package."""
    out = {}
    for mod, path in mods.items():
        found = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {(a.name, None) for a in node.names if a.name.split(".")[0] == "l2l"}
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_package, node.level, node.module) if node.level else node.module or ""
                if target.split(".")[0] != "l2l":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add((sub, None) if sub in mods else (target, alias.name))
        out[mod] = found
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    mods = _modules()
    imports = _imports(mods)
    graph = {m: {t for t, _ in found if t in mods and t != m} for m, found in imports.items()}
    assert sum(len(v) for v in graph.values()) > 50, "the import graph was not read"
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_private_name_of_another():
    mods = _modules()
    private = sorted(f"{m} imports {name} from {t}" for m, found in _imports(mods).items()
                     for t, name in found if name and name.startswith("_") and name != "__version__")
    assert not private, private


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
