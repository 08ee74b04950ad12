"""Demonstrations of the MuJoCo push task in the pipeline's shard format, and the collect +
pretrain script end to end on a small configuration."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt.policies import load
from flashrt_gym.demos.push import collect, collect_batch, push_config
from flashrt_gym.demos.push import save_shard as save_push_shard
from flashrt_gym.demos.tabletop import Windows, load_shards, save_shard
from flashrt_gym.sims import MujocoPush, PushConfig
from flashrt_gym.sims.tabletop import TabletopConfig
from flashrt_gym.splits import demo_seed

ROOT = Path(__file__).resolve().parents[3]


def test_shards_load_in_the_pipeline_and_hold_what_the_simulator_showed(tmp_path):
    cfg = PushConfig()
    batches = list(collect(cfg, 3, num_slots=4, noise_std=0.2, max_ticks=60, seed=2))
    assert sum(int(b["episode"].unique().numel()) for b in batches) == 3
    for i, b in enumerate(batches):
        save_push_shard(b, tmp_path / f"s{i}.safetensors", cfg)
    data, table = load_shards(tmp_path)  # the tabletop pipeline's loader
    assert table == cfg.table and push_config(tmp_path) == cfg
    n = len(data["tick"])
    assert data["image"].shape == (n, 64, 64, 3) and data["action"].abs().max() <= 1
    ep, tick = data["episode"], data["tick"]
    starts = torch.cat([torch.tensor([True]), ep[1:] != ep[:-1]])
    assert (tick[starts] == 0).all() and (tick[1:][~starts[1:]] == tick[:-1][~starts[1:]] + 1).all()
    # an episode's first frame is the simulator's render of its seed's start (id = slot in batch 0)
    sim = MujocoPush(4, cfg)
    sim.seed(np.arange(4) + demo_seed(2))
    sim.reset()
    first = int(data["episode"][0])
    assert torch.equal(data["image"][0], torch.from_numpy(sim.render()[first, 0]))
    assert int(data["instruction"][0]) == sim.instruction()[first]
    w = Windows(data, n_obs=2, horizon=8, stride=4, device="cpu")
    text = torch.zeros(12, 16, dtype=torch.long), torch.ones(12, 16, dtype=torch.bool)
    assert w.batch(torch.tensor([0, n - 1]), *text)["images"].shape == (2, 2, 1, 64, 64, 3)


def test_batches_are_independent_of_order_and_tabletop_shards_are_not_mujoco(tmp_path):
    cfg = PushConfig()
    kw = {"num_slots": 2, "max_ticks": 40, "seed": 1}
    later = collect_batch(cfg, 1, **kw)
    collect_batch(cfg, 0, **kw)
    again = collect_batch(cfg, 1, **kw)
    assert all(torch.equal(later[k], again[k]) for k in later)
    assert not torch.equal(collect_batch(cfg, 2, **kw)["image"][:1], later["image"][:1])  # another batch differs
    save_shard({k: v[:0] for k, v in later.items()}, tmp_path / "t.safetensors", TabletopConfig())
    with pytest.raises(ValueError, match="no MuJoCo push demonstrations"):
        push_config(tmp_path)


def test_collect_and_pretrain_script_end_to_end(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import mujoco_pretrain
    import pretrain_policy

    monkeypatch.setattr(pretrain_policy, "evaluate", pretrain_policy.evaluate)  # the script swaps it in

    args = ["--episodes", "2", "--slots", "2", "--max-ticks", "60", "--out", str(tmp_path)]
    overrides = ["steps=2", "batch_size=4", "warmup=1", "eval_every=2", "eval_episodes=1", "max_episode_steps=1"]
    summary = mujoco_pretrain.main([*args, *overrides, "device=cpu"])
    (last,) = summary["evals"]
    assert last["step"] == 2 and {"success_train", "success_heldout"} <= set(last)
    model, _ = load(tmp_path / "pretrain" / "step-2")  # a weights folder the env loads
    assert model.cfg.vocab == tuple(TabletopConfig().vocabulary)
    assert push_config(tmp_path / "demos") == PushConfig()
    monkeypatch.delitem(sys.modules, "mujoco_pretrain")
