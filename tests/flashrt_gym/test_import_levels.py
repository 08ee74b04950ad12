"""flashrt_gym's imports go down its declared levels (docs/ARCHITECTURE.md): read from the
sources with ``ast``, every import of a flashrt_gym module names a module of a lower level, and
the import graph has no cycle. The checks are run on synthetic graphs too, where an upward
import and a cycle must fail them."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flashrt_gym"

LEVELS: dict[str, int] = {
    # 0: no flashrt_gym import (the protocols, the seed blocks, the learner protocol, plain data)
    "flashrt_gym.devices": 0,
    "flashrt_gym.splits": 0,
    "flashrt_gym.deprecated": 0,
    "flashrt_gym.simulator": 0,
    "flashrt_gym.learners": 0,
    "flashrt_gym.demos": 1,
    "flashrt_gym.cli": 0,
    "flashrt_gym.sims": 0,
    "flashrt_gym.sims.metaworld_tasks": 0,
    "flashrt_gym.sims.metaworld_state": 0,
    "flashrt_gym.sims.processes": 0,
    "flashrt_gym.sims.push.warp_api": 0,
    "flashrt_gym.sims.tabletop.config": 0,
    "flashrt_gym.sims.tabletop.triton_kernels": 0,
    # 1-4: the assets, the learners and the simulators, each wing bottom-up
    "flashrt_gym.assets": 1,
    "flashrt_gym.env_config": 1,
    "flashrt_gym.learners.*": 1,
    "flashrt_gym.sims.metaworld_cpu": 2,
    "flashrt_gym.sims.tabletop.tabletop": 1,
    "flashrt_gym.sims.tabletop": 2,
    "flashrt_gym.sims.push.task": 2,
    "flashrt_gym.sims.push.render": 3,
    "flashrt_gym.sims.gymnasium_mujoco": 3,
    "flashrt_gym.sims.push.mujoco_cpu": 4,
    "flashrt_gym.sims.push.mujoco_warp": 5,
    "flashrt_gym.sims.push": 6,
    # 5-9: the engine and the env
    "flashrt_gym.engine.host_link": 5,
    "flashrt_gym.engine.engine": 6,
    "flashrt_gym.engine": 7,
    "flashrt_gym.starts": 7,
    "flashrt_gym.arguments": 0,
    "flashrt_gym.env": 9,
    # 10-12: what stands on the env, and the package's public face
    "flashrt_gym.single": 10,
    "flashrt_gym.sb3": 10,
    "flashrt_gym.evaluation": 10,
    "flashrt_gym.demos.*": 11,
    "flashrt_gym.registration": 11,
    "flashrt_gym": 12,
    # 13-17: training and the console jobs
    "flashrt_gym.training.setup": 13,
    "flashrt_gym.training.runlog": 14,
    "flashrt_gym.training.device_loop": 15,
    "flashrt_gym.training.sb3_loop": 15,
    "flashrt_gym.training": 16,
    "flashrt_gym.cli.*": 17,
    "flashrt_gym.__main__": 18,
}
"""Each module's level (the most specific pattern that matches it); an import must go to a lower one."""

DEPRECATED = {
    "flashrt_gym.fast_sac",
    "flashrt_gym.graph_sac",
    "flashrt_gym.fast_training",
    "flashrt_gym.external",
    "flashrt_gym.tasks*",
    "flashrt_gym.sims.mujoco_cpu",
    "flashrt_gym.sims.mujoco_warp",
    "flashrt_gym.sims.render",
    "flashrt_gym.sims.warp_api",
    "flashrt_gym.sims.gym_external",
    "flashrt_gym.sims.demos",
    "flashrt_gym.sims.metaworld_demos",
}
"""The old paths: aliases of their new modules, outside the levels (nothing imports them)."""


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: Path) -> dict[str, set[str]]:
    """Each module of ``package``'s imports of its other modules, wherever they stand (lazy ones
    inside functions too); ``from pkg import name`` counts as an import of ``pkg.name`` when that
    is a module, else of ``pkg``."""
    modules = {module_name(p, package) for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        name = module_name(path, package)
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules
                edges |= subs or {node.module}
        edges.discard(name)
    return graph


def level(module: str) -> int | None:
    matches = [p for p in LEVELS if fnmatch.fnmatchcase(module, p)]
    return LEVELS[max(matches, key=lambda p: (p.count("."), "*" not in p))] if matches else None


def upward(graph: dict[str, set[str]], levels: dict[str, int]) -> list[tuple[str, str]]:
    """The imports that do not go to a lower level."""
    return sorted((a, b) for a, deps in graph.items() for b in deps if levels[b] >= levels[a])


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order), or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def package_graph() -> dict[str, set[str]]:
    graph = imports(PACKAGE)
    return {m: deps for m, deps in graph.items() if not any(fnmatch.fnmatchcase(m, d) for d in DEPRECATED)}


def test_every_module_has_a_declared_level():
    graph = package_graph()
    assert not [m for m in graph if level(m) is None], "place each new module in LEVELS (and docs/ARCHITECTURE.md)"


def test_flashrt_gym_imports_only_go_down_and_have_no_cycle():
    graph = package_graph()
    levels = {m: level(m) for m in {*graph, *(d for deps in graph.values() for d in deps)}}
    assert not [m for m, lv in levels.items() if lv is None], "an import of an old (deprecated) path"
    assert upward(graph, levels) == []
    assert cycle(graph) == []


def test_the_checks_fail_on_an_upward_import_and_on_a_cycle():
    """Mutation: the real graph with one import added upward (the env importing training, the
    cycle the package once had) must fail both checks; so must a bare two-module cycle."""
    graph = {m: set(deps) for m, deps in package_graph().items()}
    levels = {m: level(m) for m in graph}
    graph["flashrt_gym.env"].add("flashrt_gym.training")
    assert upward(graph, levels) == [("flashrt_gym.env", "flashrt_gym.training")]
    assert cycle(graph)[0] == cycle(graph)[-1] and "flashrt_gym.training" in cycle(graph)
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert upward({"a": {"b"}, "b": set()}, {"a": 1, "b": 1}) == [("a", "b")]  # the same level is not lower


@pytest.mark.parametrize(
    "source", ["import flashrt_gym.env", "from flashrt_gym import env", "from flashrt_gym.env import X"]
)
def test_every_import_form_is_read_even_inside_a_function(tmp_path, source):
    package = tmp_path / "flashrt_gym"
    package.mkdir()
    for name, text in (("__init__", ""), ("env", ""), ("single", f"def f():\n    {source}\n")):
        (package / f"{name}.py").write_text(text)
    assert imports(package)["flashrt_gym.single"] == {"flashrt_gym.env"}
