"""Package structure: no import cycles (module-level or inside functions;
type-checking-only imports aside), and the lower layers never reach up."""
from __future__ import annotations

import ast
import pathlib

import rollout_engine

ROOT = pathlib.Path(rollout_engine.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("rollout_engine",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for stmt in node.orelse:
                    self.visit(stmt)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    # An import of a.b.c also runs a and a.b.
    closure = set()
    for dep in found:
        bits = dep.split(".")
        closure.update(".".join(bits[:i]) for i in range(1, len(bits) + 1))
    return {d for d in closure if d in known and d != name and not name.startswith(d + ".")
            and d != "rollout_engine"}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_lower_layers_do_not_import_upper_ones():
    graph = _graph()
    lower = ("rollout_engine.layers", "rollout_engine.models", "rollout_engine.attention", "rollout_engine.kernels",
             "rollout_engine.plan", "rollout_engine.forward_batch")
    upper = ("rollout_engine.runner", "rollout_engine.scheduler", "rollout_engine.core", "rollout_engine.engine")
    bad = [(m, d) for m, deps in graph.items() if m.startswith(lower) for d in deps if d.startswith(upper)]
    assert not bad
    runner = [(m, d) for m, deps in graph.items() if m.startswith("rollout_engine.runner")
              for d in deps if d.startswith(("rollout_engine.scheduler", "rollout_engine.request"))]
    assert not runner, "the runner sees plans, never scheduler objects"


def test_the_facade_stays_small():
    assert len((ROOT / "engine.py").read_text().splitlines()) <= 200


def test_every_subpackage_is_installed():
    """A non-editable install ships only the packages pyproject.toml lists:
    a folder missing there works from a checkout and breaks once installed."""
    import tomllib

    root = pathlib.Path(rollout_engine.__file__).parent
    project = tomllib.loads((root.parent / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    found = {"rollout_engine." + d.name for d in root.iterdir() if (d / "__init__.py").exists()}
    assert found - listed == set()
