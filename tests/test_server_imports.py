"""The server package's modules depend one way: no import cycle, and the three HTTP APIs (OpenAI,
Responses, Anthropic) share the bridge, fields, tools and streams without importing one another."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import ellmd.server

PACKAGE = "ellmd.server"
APIS = {"ellmd.server.http.openai", "ellmd.server.http.responses", "ellmd.server.http.anthropic"}


def modules() -> dict[str, Path]:
    """Every module of the server package -> its file."""
    found = {PACKAGE: Path(ellmd.server.__file__)}
    for info in pkgutil.walk_packages(ellmd.server.__path__, PACKAGE + "."):
        spec = importlib.util.find_spec(info.name)
        found[info.name] = Path(spec.origin)
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The server modules a module imports, at its top or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from package import module`
    return {target for target in found if target in known and target != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order), else None."""
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(edges[name]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[name] = "done"
        return None

    for name in sorted(edges):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_the_server_modules_have_no_import_cycle():
    edges = graph()
    assert {"ellmd.server.http.site", "ellmd.server.http.bridge", *APIS} <= edges.keys()
    assert cycle(edges) is None, f"import cycle: {' -> '.join(cycle(edges))}"


def test_the_cycle_check_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_apis_do_not_import_one_another():
    edges = graph()
    for api in APIS:
        assert not edges[api] & APIS, f"{api} imports {edges[api] & APIS}"
        assert "ellmd.server.http.site" not in edges[api], f"{api} imports the site"
