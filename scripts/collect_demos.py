"""Collect scripted-expert demonstrations on the built-in tabletop as safetensors shards.

python scripts/collect_demos.py num_episodes=4000 noise_std=0.3 out=demos
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from flashrt_gym.demos.tabletop import collect, save_shard
from flashrt_gym.devices import resolve_device
from flashrt_gym.sims.tabletop import TabletopConfig

logger = logging.getLogger(__name__)


def run(cfg: DictConfig) -> list[Path]:
    task_cfg = TabletopConfig(**OmegaConf.to_container(cfg.task, resolve=True))
    out = Path(cfg.out)
    written, pending, shard_no = [], [], 0
    bar = tqdm(total=cfg.num_episodes, desc="demos", unit="ep")

    def flush() -> None:
        nonlocal pending, shard_no
        if not pending:
            return
        shard = {k: torch.cat([p[k] for p in pending]) for k in pending[0]}
        written.append(save_shard(shard, out / f"shard-{shard_no:04d}.safetensors", task_cfg))
        pending, shard_no = [], shard_no + 1

    kept = 0
    for batch in collect(
        task_cfg,
        cfg.num_episodes,
        num_slots=cfg.num_slots,
        noise_std=cfg.noise_std,
        max_ticks=cfg.max_ticks,
        seed=cfg.seed,
        device=resolve_device(cfg.device),
    ):
        n = int(batch["episode"].unique().numel())
        pending.append(batch)
        kept += n
        bar.update(n)
        if sum(int(p["episode"].unique().numel()) for p in pending) >= cfg.shard_episodes:
            flush()
    flush()
    bar.close()
    logger.info("collect_demos: %d episodes in %d shards under %s", kept, len(written), out)
    return written


@hydra.main(version_base="1.3", config_path="../configs", config_name="collect_demos")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
