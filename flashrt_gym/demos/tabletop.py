"""The built-in tabletop's demonstrations: the scripted expert's episodes as shards
(:mod:`flashrt_gym.demos`), and :class:`Windows`, the windows BC trains on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from flashrt.runtime import BufferSet, atomic_write
from flashrt_gym.demos import FORMAT
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig
from flashrt_gym.splits import demo_seed


def collect(
    task: TabletopConfig,
    num_episodes: int,
    *,
    num_slots: int = 256,
    noise_std: float = 0.3,
    max_ticks: int = 160,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """Run the expert (plus Gaussian action noise) of ``task``'s configuration in batches of
    ``num_slots`` episodes and yield one batch of successful episodes at a time, on the CPU.
    Episode ``e`` of the collection (kept or not) starts from :func:`flashrt_gym.splits.demo_seed`
    ``(seed, e)``: the demonstrations' own block, disjoint from training and evaluation starts."""
    if num_episodes < 1 or num_slots < 1 or max_ticks < 1:
        raise ValueError("num_episodes, num_slots and max_ticks must be >= 1")
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    done, first_episode = 0, 0
    g = torch.Generator(device=device).manual_seed(seed)
    cfg = task
    while done < num_episodes:
        sim = Tabletop(cfg)
        sim.bind(BufferSet(sim.specs(), num_slots, device))
        sim.seed(torch.arange(num_slots, device=device) + demo_seed(seed, first_episode))
        sim.reset()
        frames = []
        for _ in range(max_ticks):
            alive = ~sim.success
            noise = torch.randn(num_slots, 2, generator=g, device=device) * noise_std
            action = (sim.expert() + noise).clamp(-1.0, 1.0)
            image = torch.empty(num_slots, 1, cfg.image_size, cfg.image_size, 3, dtype=torch.uint8, device=device)
            proprio = torch.empty(num_slots, sim.proprio_dim, device=device)
            sim.render(out=image)
            sim.proprio(out=proprio)
            frames.append((image[:, 0], proprio, action, alive))
            sim.step(action)
        image, proprio, action, alive = (torch.stack(x, 1).cpu() for x in zip(*frames, strict=True))
        ok = sim.success.cpu()
        keep = ok.nonzero().flatten()[: num_episodes - done]
        lengths = alive[keep].sum(1)
        sel = alive[keep]
        ids = torch.arange(first_episode, first_episode + len(keep))
        yield {
            "image": image[keep][sel],
            "proprio": proprio[keep][sel],
            "action": action[keep][sel],
            "instruction": sim.instruction.cpu()[keep].repeat_interleave(lengths),
            "episode": ids.repeat_interleave(lengths),
            "tick": torch.cat([torch.arange(n) for n in lengths.tolist()])
            if len(keep)
            else torch.zeros(0, dtype=torch.int64),
        }
        done += len(keep)
        first_episode += num_slots


def save_shard(shard: dict[str, torch.Tensor], path: str | os.PathLike, task: TabletopConfig) -> Path:
    meta = {
        "format": FORMAT,
        "task": json.dumps({k: v for k, v in asdict(task).items() if k != "heldout"}),
        "instructions": json.dumps(Tabletop(task).instructions),
    }
    tensors = {k: v.contiguous() for k, v in shard.items()}
    return atomic_write(path, lambda f: f.write(save_bytes(tensors, metadata=meta)))


def load_shards(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], TabletopConfig]:
    """Concatenate every ``*.safetensors`` shard in ``folder``; all must share one task.

    Args:
        folder: a folder of shards from :func:`save_shard` (or the MuJoCo push task's, which share
            the tabletop's task configuration).

    Returns:
        The concatenated ticks and the tabletop configuration they were collected on.

    Raises:
        FileNotFoundError: no shard in ``folder``.
        ValueError: a shard of another format or task, or shards of another simulator.
    """
    paths = sorted(Path(folder).glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no demonstration shards (*.safetensors) in {folder}; run scripts/collect_demos.py")
    parts, task_json = [], None
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{p} is not a {FORMAT} shard")
            if task_json is not None and meta["task"] != task_json:
                raise ValueError(f"{p} was collected on another task configuration than {paths[0]}")
            task_json = meta["task"]
            parts.append({k: f.get_tensor(k) for k in f.keys()})
    data = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    try:
        task = TabletopConfig(**json.loads(task_json))
    except TypeError as e:  # another simulator's shards (Meta-World's task is no tabletop configuration)
        raise ValueError(
            f"the shards in {folder} hold no tabletop task configuration ({e}): shards of another simulator "
            "load with that simulator's load_shards (flashrt_gym.demos.metaworld for Meta-World)"
        ) from e
    return data, task


class Windows:
    """Training windows over demonstration ticks, matching what the policy sees at run time:
    frames every ``stride`` ticks (the env's ``n_action_steps``), the last ``n_obs`` of them,
    earlier-than-start frames masked, and the next ``horizon`` actions (masked past the end)."""

    def __init__(self, data: dict[str, torch.Tensor], *, n_obs: int, horizon: int, stride: int, device) -> None:
        self.d = {k: v.to(device) for k, v in data.items()}
        self.n_obs, self.horizon, self.stride = n_obs, horizon, stride
        ep = self.d["episode"]
        start = torch.ones_like(ep, dtype=torch.bool)
        start[1:] = ep[1:] != ep[:-1]
        starts = torch.nonzero(start).flatten()
        lengths = torch.diff(torch.cat([starts, torch.tensor([len(ep)], device=ep.device)]))
        self.end = (starts + lengths).repeat_interleave(lengths)  # one past each tick's episode end
        self.len = len(ep)

    def __len__(self) -> int:
        return self.len

    def batch(self, idx: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The training batch of the windows ending at ticks ``idx`` (B,)."""
        d, tick = self.d, self.d["tick"][idx]
        back = torch.arange(self.n_obs - 1, -1, -1, device=idx.device) * self.stride  # oldest first
        frame_tick = tick[:, None] - back
        valid = frame_tick >= 0
        fidx = torch.where(valid, idx[:, None] - back, idx[:, None] - tick[:, None])  # else the first frame
        aidx = idx[:, None] + torch.arange(self.horizon, device=idx.device)
        amask = aidx < self.end[idx, None]
        aidx = torch.minimum(aidx, self.end[idx, None] - 1)
        instr = d["instruction"][idx]
        return {
            "text_ids": text_ids[instr],
            "text_mask": text_mask[instr],
            "images": d["image"][fidx][:, :, None],  # one camera
            "proprio": d["proprio"][fidx],
            "frame_valid": valid,
            "frame": tick // self.stride,
            "actions": d["action"][aidx],
            "action_mask": amask,
        }
