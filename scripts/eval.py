"""Evaluate a trained agent, or the unsteered base policy, on FlashRT-VLA.

    python scripts/eval.py checkpoint=outputs/<run>/checkpoints/last.zip eval.episodes=512
    python scripts/eval.py                                   # the base policy alone
    python scripts/eval.py +video=videos/                    # also record two episodes

Uses the same config groups as train.py (env, task, policy, agent, runtime).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import hydra
import numpy as np
from gymnasium.wrappers import RecordVideo
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from flashrt_gym import FlashRTEnv
from flashrt_gym.training import device_of, evaluate, evaluate_base, make_env


def record(cfg: DictConfig, act: Callable[[np.ndarray], np.ndarray], action_mode: str, folder: str) -> None:
    """Two episodes of one slot as videos in ``folder``."""
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    env_cfg.pop("num_envs")
    env_cfg["action_mode"] = action_mode
    single = FlashRTEnv(render_mode="rgb_array", device=device_of(cfg), weights=cfg.policy.weights, **env_cfg)
    env = RecordVideo(single, folder, episode_trigger=lambda _: True, disable_logger=True)
    for ep in range(2):
        obs, _ = env.reset(seed=cfg.eval.seed + ep)
        done = False
        while not done:
            obs, _, term, trunc, _ = env.step(act(obs[None])[0])
            done = term or trunc
    env.close()


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    checkpoint, video = cfg.get("checkpoint"), cfg.get("video")
    if checkpoint:
        model = get_class(cfg.agent._target_).load(checkpoint, device=device_of(cfg))

        def act(obs: np.ndarray) -> np.ndarray:
            return model.predict(obs, deterministic=True)[0]

        res, mode = evaluate(make_env(cfg, cfg.eval.episodes, autoreset=False), act, cfg.eval.seed), cfg.env.action_mode
    else:
        res, mode = evaluate_base(cfg), "residual"

        def act(obs: np.ndarray) -> np.ndarray:  # no correction: the base policy's own noise
            return np.zeros((len(obs), res.action_dim), np.float32)

    print(
        json.dumps(
            {
                "checkpoint": checkpoint,
                "episodes": cfg.eval.episodes,
                "success": res.success,
                "mean_return": res.mean_return,
            }
        )
    )
    if video:
        record(cfg, act, mode, str(video))


if __name__ == "__main__":
    main()
