"""scripts/pretrain_policy.py on a few demonstrations: updates with a non-finite gradient are
skipped and counted, a run whose updates all are stops with its weights and batch kept, and a
run can start from a weights folder (fine-tuning); the loss never runs on cuDNN's attention."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from flashrt.policies import FlowPolicy, load
from flashrt_gym.assets import TINY
from flashrt_gym.demos.tabletop import collect, save_shard
from flashrt_gym.sims.tabletop import TabletopConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    folder, cfg = tmp_path_factory.mktemp("demos"), TabletopConfig()
    for i, b in enumerate(collect(cfg, 2, num_slots=2, noise_std=0.2, max_ticks=60, seed=1)):
        save_shard(b, folder / f"shard-{i:04d}.safetensors", cfg)
    return folder


def pretrain(monkeypatch, demos: Path, out: Path, *overrides: str):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import pretrain_policy

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="pretrain",
            overrides=[f"demos={demos}", f"out={out}", "device=cpu", "batch_size=2", "warmup=1", *overrides],
        )
    return pretrain_policy.run(cfg)


def poisoned_at(steps: set[int]):
    """FlowPolicy.loss, made infinite at the given calls (1-based)."""
    loss, calls = FlowPolicy.loss, [0]

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        out = loss(self, *args, **kwargs)
        return out * math.inf if calls[0] in steps else out

    return wrapped


def test_a_non_finite_update_is_skipped_and_counted(demos, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(FlowPolicy, "loss", poisoned_at({2}))
    overrides = ["steps=3", "eval_every=3", "eval_episodes=1", "max_episode_steps=1"]
    with caplog.at_level(logging.INFO, logger="pretrain_policy"):  # the run's log (Hydra's file), not print
        summary = pretrain(monkeypatch, demos, tmp_path, *overrides)
    line = next(r.getMessage() for r in caplog.records if "update skipped" in r.getMessage())
    assert line.startswith("step 2: update skipped (1 so far), non-finite gradients in") and "vision_pos" in line
    assert summary["skipped_steps"] == 1 and [e["step"] for e in summary["evals"]] == [3]
    assert json.loads((tmp_path / "evals.json").read_text())["skipped_steps"] == 1


@pytest.mark.parametrize(("poisoned", "verdict"), [({2, 3, 4}, "are finite"), ({2, 3, 4, 5}, "are non-finite too")])
def test_a_run_that_no_longer_moves_stops_with_its_weights_and_batch(demos, tmp_path, monkeypatch, poisoned, verdict):
    """Three non-finite updates in a row stop the run; the last batch is run again with SDPA's
    math backend (the loss's fifth call), whose verdict the error gives."""
    monkeypatch.setattr(FlowPolicy, "loss", poisoned_at(poisoned))
    with pytest.raises(FloatingPointError, match="3 updates in a row had a non-finite gradient norm") as err:
        pretrain(monkeypatch, demos, tmp_path, "steps=10", "eval_every=10", "max_skipped_in_a_row=3")
    assert f"math backend the last batch's gradients {verdict}" in str(err.value)
    folder = tmp_path / "nonfinite-step-4"
    model, _ = load(folder)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the weights of step 1's update
    batch = torch.load(folder / "batch.pt")
    assert batch["idx"].shape == (2,) and batch["generator"].dtype == torch.uint8
    assert not (tmp_path / "step-10").exists()


@pytest.mark.parametrize("init", [True, False])
def test_a_run_can_start_from_a_weights_folder(demos, tmp_path, monkeypatch, init):
    """``init``: the run starts from those weights (with lr 0 its checkpoint is them, to the
    bit); without it (the mutation) from a fresh model."""
    overrides = ["steps=1", "eval_every=1", "eval_episodes=1", "max_episode_steps=1", "lr=0"]
    pretrain(monkeypatch, demos, tmp_path, *overrides, f"init={TINY if init else 'null'}")
    got, want = load_file(tmp_path / "step-1" / "model.safetensors"), load_file(TINY / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want) == init


def test_init_of_another_configuration_is_refused(demos, tmp_path, monkeypatch, micro):
    with pytest.raises(ValueError, match="holds a model of another configuration than preset=tiny"):
        pretrain(monkeypatch, demos, tmp_path, "steps=1", f"init={micro}")


def test_the_loss_runs_without_cudnn_attention(demos, tmp_path, monkeypatch):
    """cuDNN's SDPA backward returns NaN gradients on H100/H200 (``TRAIN_ATTENTION``): every
    training loss runs with that backend off. It is on by default (so a run without the guard,
    the mutation, would see it on), and on again after the run."""
    seen, loss = [], FlowPolicy.loss

    def spy(self, *args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return loss(self, *args, **kwargs)

    assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(FlowPolicy, "loss", spy)
    pretrain(monkeypatch, demos, tmp_path, "steps=2", "eval_every=2", "eval_episodes=1", "max_episode_steps=1")
    assert seen == [False, False]
    assert torch.backends.cuda.cudnn_sdp_enabled()
