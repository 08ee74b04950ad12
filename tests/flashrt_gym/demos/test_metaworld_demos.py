"""Meta-World demonstrations in the pipeline's shard format (round trip, foreign shards refused,
starts from the demonstrations' seed block only), and scripts/metaworld_pretrain.py end to end."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("metaworld", reason="Meta-World is installed by scripts/install_metaworld.sh")

from safetensors import safe_open
from safetensors.torch import save_file

from flashrt.policies import load
from flashrt_gym.demos.metaworld import (
    MetaWorldTask,
    collect_batch,
    episodes_per_task,
    first_episodes_per_task,
    load_shards,
    save_shard,
)
from flashrt_gym.demos.tabletop import Windows
from flashrt_gym.demos.tabletop import save_shard as save_tabletop_shard
from flashrt_gym.sims import metaworld_cpu
from flashrt_gym.sims.tabletop import TabletopConfig
from flashrt_gym.splits import TEST_SEED, VALIDATION_SEED, demo_seed, train_seed

ROOT = Path(__file__).resolve().parents[3]
TASK = MetaWorldTask(("reach-v3", "button-press-topdown-v3"))


@pytest.fixture(scope="module")
def shard() -> dict[str, torch.Tensor]:
    """Batch 0 of collection 1: four episodes, two of each task, all successful within 100 ticks."""
    out = collect_batch(TASK, 0, num_slots=4, noise_std=0.2, max_ticks=100, seed=1)
    assert out["episode"].unique().tolist() == [0, 1, 2, 3]
    return out


def test_shards_round_trip_and_hold_what_the_simulator_showed_from_demo_starts(shard, tmp_path):
    save_shard(shard, tmp_path / "a.safetensors", TASK, {"noise_std": 0.2})
    data, task = load_shards(tmp_path)
    assert task == TASK and all(torch.equal(data[k], shard[k]) for k in shard)
    n = len(data["tick"])
    assert data["image"].shape == (n, 64, 64, 3) and data["proprio"].shape == data["action"].shape == (n, 4)
    assert data["action"].abs().max() <= 1 and episodes_per_task(data, 2).tolist() == [2, 2]
    ep, tick = data["episode"], data["tick"]
    starts = torch.cat([torch.tensor([True]), ep[1:] != ep[:-1]])
    assert (tick[starts] == 0).all() and (tick[1:][~starts[1:]] == tick[:-1][~starts[1:]] + 1).all()
    # each episode's first frame is the render of its demonstration seed's start, not of another block's
    sim = TASK.simulator(4)
    for first, other in ((demo_seed(1), False), (VALIDATION_SEED, True)):
        sim.seed(np.arange(4) + first)
        sim.reset()
        frames = torch.from_numpy(sim.render()[:, 0])
        for e in range(4):
            at = int((ep == e).nonzero()[0])
            same = torch.equal(data["image"][at], frames[e]) and int(data["instruction"][at]) == e % 2
            assert same != other
    w = Windows(data, n_obs=2, horizon=8, stride=4, device="cpu")
    text = torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.bool)
    assert w.batch(torch.tensor([0, n - 1]), *text)["proprio"].shape == (2, 2, 4)


def test_foreign_shards_are_refused(shard, tmp_path):
    mine = save_shard(shard, tmp_path / "a.safetensors", TASK)
    (tmp_path / "other").mkdir()
    save_shard(shard, tmp_path / "other" / "b.safetensors", MetaWorldTask(TASK.tasks, camera="corner"))
    load_shards(tmp_path / "other")  # a setting of its own loads alone
    (tmp_path / "other" / "a.safetensors").write_bytes(mine.read_bytes())
    with pytest.raises(ValueError, match="another Meta-World setting"):
        load_shards(tmp_path / "other")
    with safe_open(str(mine), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    forged = tmp_path / "forged"
    forged.mkdir()
    save_file(tensors, forged / "a.safetensors", {**meta, "identity": meta["identity"].replace("metaworld=", "mw=")})
    with pytest.raises(ValueError, match="collect them again"):
        load_shards(forged)
    table = tmp_path / "table"
    table.mkdir()
    save_tabletop_shard({k: v[:0] for k, v in shard.items()}, table / "t.safetensors", TabletopConfig())
    with pytest.raises(ValueError, match="no Meta-World demonstrations"):
        load_shards(table)
    with pytest.raises(FileNotFoundError, match="no demonstration shards"):
        load_shards(tmp_path / "none")


def test_first_episodes_per_task_keeps_each_tasks_quota(shard):
    kept = first_episodes_per_task(shard, [1, 0])
    assert kept["episode"].unique().tolist() == [0] and episodes_per_task(kept, 2).tolist() == [1, 0]
    assert torch.equal(first_episodes_per_task(shard, [5, 5])["tick"], shard["tick"])


def starts(seeds: np.ndarray) -> np.ndarray:
    """The start observations (hand, object and goal positions) the slots of ``TASK`` draw from ``seeds``."""
    sim = TASK.simulator(len(seeds))
    sim.seed(seeds)
    sim.reset()
    return sim.observation()


def coinciding(blocks: dict[str, np.ndarray]) -> set[tuple[str, str]]:
    """Pairs of blocks that share a drawn start state (slot i of every block runs the same task)."""
    drawn = {name: starts(seeds) for name, seeds in blocks.items()}
    return {(a, b) for a in drawn for b in drawn if a < b and any((drawn[a][:, None] == drawn[b][None]).all(-1).any(1))}


def test_demonstration_starts_are_none_of_the_evaluation_or_training_starts(monkeypatch):
    k = np.arange(6)
    blocks = {
        "demonstrations": k + demo_seed(1),
        "validation": k + VALIDATION_SEED,
        "test": k + TEST_SEED,
        "run 0": k + train_seed(0, 6),
    }
    assert coinciding(blocks) == set()
    assert len(np.unique(starts(k + demo_seed(1)), axis=0)) == len(k)  # distinct within the block too
    # mutation: a stream keyed by the seed's low 32 bits gives every block the same starts
    monkeypatch.setattr(metaworld_cpu, "_uint64", lambda key: int(key) & 0xFFFFFFFF)
    assert {("demonstrations", "validation"), ("test", "validation"), ("demonstrations", "run 0")} <= coinciding(blocks)


def test_batches_are_independent_of_order():
    task, kw = MetaWorldTask(("reach-v3",)), {"num_slots": 2, "max_ticks": 80, "seed": 3}
    later = collect_batch(task, 1, **kw)
    collect_batch(task, 0, **kw)
    again = collect_batch(task, 1, **kw)
    assert len(later["tick"]) and all(torch.equal(later[k], again[k]) for k in later)
    assert later["episode"].unique().tolist() == [2, 3]
    quiet = collect_batch(task, 1, **{**kw, "noise_std": 0.0})  # the noise is part of what a batch holds
    assert not torch.equal(quiet["action"][:5], later["action"][:5])


def test_collect_pretrain_choose_and_test_end_to_end(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import metaworld_pretrain
    import pretrain_policy

    for name in ("load_shards", "instructions", "evaluate"):  # the script swaps them in
        monkeypatch.setattr(pretrain_policy, name, getattr(pretrain_policy, name))
    calls, real = [], metaworld_pretrain.evaluate
    bonus = {"step-1": 0.25, "step-2": 0.75, "step-3": 0.5}  # the validation scores the choice must follow

    def recorded(weights, task, *, seed, **kw):
        calls.append((Path(weights).name, seed))
        rates = real(weights, task, seed=seed, **kw)
        return {**rates, "mean": rates["mean"] + bonus[Path(weights).name] * (seed == VALIDATION_SEED)}

    monkeypatch.setattr(metaworld_pretrain, "evaluate", recorded)
    args = ["--tasks", *TASK.tasks, "--episodes", "2", "--slots", "4", "--max-ticks", "100", "--eval-processes", "2"]
    args += ["--out", str(tmp_path)]  # the evaluations' two slots (one episode of each task) in two processes
    overrides = ["steps=3", "batch_size=4", "warmup=1", "eval_every=1", "eval_episodes=1", "max_episode_steps=2"]
    result = metaworld_pretrain.main([*args, *overrides, "device=cpu"])
    validation = [(f"step-{s}", VALIDATION_SEED) for s in (1, 2, 3)]
    assert calls == [*validation, ("step-2", TEST_SEED)]  # every choice on validation, then one test run
    assert result["chosen"]["step"] == 2 and set(result["test"]) == {*TASK.tasks, "mean"}
    assert json.loads((tmp_path / "base.json").read_text()) == result
    assert result["argv"] == [*args, *overrides, "device=cpu"] and result["machine"]["torch"] == torch.__version__
    model, _ = load(tmp_path / "pretrain" / "step-2")
    assert model.cfg.vocab == tuple(TASK.vocabulary) and model.cfg.action_dim == model.cfg.proprio_dim == 4
    data, task = load_shards(tmp_path / "demos")
    assert task == TASK and episodes_per_task(data, 2).tolist() == [2, 2]
    monkeypatch.delitem(sys.modules, "metaworld_pretrain")


def test_a_ceiling_chooses_the_best_checkpoint_at_or_below_it(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from metaworld_pretrain import choose

    evals = [{"step": s, "success_mean": m} for s, m in ((1, 0.25), (2, 0.75), (3, 0.5), (4, 0.5))]
    assert choose(evals, None)["step"] == 2
    assert choose(evals, 0.6)["step"] == 3  # the earliest of equals
    assert choose(evals, 0.2)["step"] == 1  # none at or below: the lowest
