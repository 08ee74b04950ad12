"""The module paths of the previous layout still import for one release: each is its new module
itself (classes keep their identity, pickles that name the old path load), and importing it, or
a name moved out of a module that stays, warns with the new place."""

import importlib
import sys
import warnings

import pytest

MOVED = [
    ("flashrt_gym.fast_sac", "flashrt_gym.learners.fast_sac"),
    ("flashrt_gym.graph_sac", "flashrt_gym.learners.graph_sac"),
    ("flashrt_gym.fast_training", "flashrt_gym.training.device_loop"),
    ("flashrt_gym.tasks.tabletop", "flashrt_gym.sims.tabletop.tabletop"),
    ("flashrt_gym.tasks.tabletop_config", "flashrt_gym.sims.tabletop.config"),
    ("flashrt_gym.tasks.tabletop_kernels", "flashrt_gym.sims.tabletop.triton_kernels"),
    ("flashrt_gym.sims.mujoco_cpu", "flashrt_gym.sims.push.mujoco_cpu"),
    ("flashrt_gym.sims.mujoco_warp", "flashrt_gym.sims.push.mujoco_warp"),
    ("flashrt_gym.sims.render", "flashrt_gym.sims.push.render"),
    ("flashrt_gym.sims.warp_api", "flashrt_gym.sims.push.warp_api"),
    ("flashrt_gym.sims.gym_external", "flashrt_gym.sims.gymnasium_mujoco"),
    ("flashrt_gym.sims.demos", "flashrt_gym.demos.push"),
    ("flashrt_gym.sims.metaworld_demos", "flashrt_gym.demos.metaworld"),
]
NAMES = [
    ("flashrt_gym.training", "evaluate", "flashrt_gym.evaluation"),
    ("flashrt_gym.training", "RunLog", "flashrt_gym.training.runlog"),
    ("flashrt_gym.external", "ExternalSimulator", "flashrt_gym.simulator"),
    ("flashrt_gym.external", "check_simulator", "flashrt_gym.simulator"),
    ("flashrt_gym.external", "Mirror", "flashrt_gym.engine.host_link"),
    ("flashrt_gym.demos", "Windows", "flashrt_gym.demos.tabletop"),
]


def needs(new: str) -> str | None:
    """The simulator library the module ``new`` imports, if any."""
    if "metaworld" in new:
        return "metaworld"
    return "mujoco" if "push" in new or "gymnasium_mujoco" in new else None


@pytest.mark.parametrize(("old", "new"), MOVED)
def test_an_old_module_path_is_the_new_module_and_warns(monkeypatch, old, new):
    if needs(new):
        pytest.importorskip(needs(new))
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} has moved to {new}; import it from there"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_old_tasks_package_gives_the_tabletops_names_and_warns(monkeypatch):
    from flashrt_gym.sims import tabletop

    monkeypatch.delitem(sys.modules, "flashrt_gym.tasks", raising=False)
    with pytest.warns(DeprecationWarning, match="flashrt_gym.tasks has moved to flashrt_gym.sims.tabletop"):
        tasks = importlib.import_module("flashrt_gym.tasks")
    assert tasks.Tabletop is tabletop.Tabletop and tasks.TabletopConfig is tabletop.TabletopConfig


@pytest.mark.parametrize(("module", "name", "new"), NAMES)
def test_a_name_moved_out_of_a_module_resolves_there_and_warns(module, name, new):
    old = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} has moved to {new}.{name}"):
        assert getattr(old, name) is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        old.nope  # noqa: B018


def test_the_new_paths_import_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for _, new in MOVED:
            if needs(new) is None:
                importlib.import_module(new)
