import json

import pytest
import torch
from safetensors.torch import save_file

from flashrt_gym.demos.tabletop import FORMAT, Windows, collect, load_shards, save_shard
from flashrt_gym.sims.tabletop import TabletopConfig


def test_collected_shards_round_trip_and_windows_follow_the_runtime_layout(tmp_path):
    cfg = TabletopConfig()
    batches = list(collect(cfg, 10, num_slots=8, noise_std=0.2, max_ticks=120, seed=3))
    assert sum(int(b["episode"].unique().numel()) for b in batches) == 10
    for i, b in enumerate(batches):
        save_shard(b, tmp_path / f"s{i}.safetensors", cfg)
    data, got_cfg = load_shards(tmp_path)
    assert got_cfg == cfg
    n = len(data["tick"])
    assert data["image"].shape == (n, 64, 64, 3) and data["image"].dtype == torch.uint8
    # ticks count up from 0 inside each episode
    ep, tick = data["episode"], data["tick"]
    starts = torch.cat([torch.tensor([True]), ep[1:] != ep[:-1]])
    assert (tick[starts] == 0).all() and (tick[1:][~starts[1:]] == tick[:-1][~starts[1:]] + 1).all()

    w = Windows(data, n_obs=2, horizon=8, stride=4, device="cpu")
    text_ids = torch.arange(12)[:, None].repeat(1, 16)
    text_mask = torch.ones(12, 16, dtype=torch.bool)
    first, late = 0, int(torch.nonzero(tick == 9)[0])
    b = w.batch(torch.tensor([first, late]), text_ids, text_mask)
    assert b["images"].shape == (2, 2, 1, 64, 64, 3)
    assert b["frame_valid"].tolist() == [[False, True], [True, True]]
    assert b["frame"].tolist() == [0, 2]  # tick 9 is frame 9 // 4
    assert torch.equal(b["images"][1, 0, 0], data["image"][late - 4]) and torch.equal(
        b["images"][1, 1, 0], data["image"][late]
    )
    assert torch.equal(b["images"][0, 0, 0], data["image"][first])  # before the start: the first frame, masked
    k = int(b["action_mask"][1].sum())
    assert k >= 1 and torch.equal(b["actions"][1, :k], data["action"][late : late + k])
    assert torch.equal(b["text_ids"][1], text_ids[data["instruction"][late]])
    # past the episode's end the actions are masked
    last = int(torch.nonzero(torch.cat([ep[1:] != ep[:-1], torch.tensor([True])]))[0])
    tail = w.batch(torch.tensor([last]), text_ids, text_mask)
    assert tail["action_mask"][0].tolist() == [True] + [False] * 7


def test_shards_of_another_simulator_are_named_not_misread(tmp_path):
    """A shard whose task is no tabletop configuration (Meta-World's, say) is refused with a
    ValueError that names the loader to use, not a TypeError from deep inside."""
    meta = {"format": FORMAT, "task": json.dumps({"tasks": ["reach-v3"], "image_size": 64}), "simulator": "metaworld"}
    save_file({"tick": torch.zeros(1, dtype=torch.int64)}, str(tmp_path / "s.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="shards of another simulator load with that simulator's load_shards"):
        load_shards(tmp_path)
