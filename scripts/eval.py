"""Evaluate a trained agent, or the unsteered base policy, on FlashRT-VLA's evaluation starts.

    python scripts/eval.py +checkpoint=outputs/<run>/checkpoints/last.safetensors   # FastSAC
    python scripts/eval.py agent=sac +checkpoint=outputs/<run>/checkpoints/last.zip # an SB3 agent
    python scripts/eval.py                                   # the base policy alone
    python scripts/eval.py +split=test +video=videos/        # the test starts; two episodes as videos

Uses the same config groups as train.py (env, task, policy, agent, runtime); the split is
``validation`` unless ``+split=test`` (flashrt_gym.splits). Prints one JSON line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import hydra
import numpy as np
from gymnasium.utils.save_video import save_video
from hydra.utils import get_class
from omegaconf import DictConfig

from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.fast_sac import FastSAC
from flashrt_gym.fast_training import learner_config
from flashrt_gym.splits import eval_seed
from flashrt_gym.training import check, device_of, evaluate, is_fast, make_env, torch_policy

Act = Callable[[np.ndarray], np.ndarray]


def load_agent(cfg: DictConfig, checkpoint: str, env: FlashRTVectorEnv) -> Act:
    """The deterministic policy of ``checkpoint`` (a FastSAC safetensors file, or an SB3 zip)."""
    if is_fast(cfg):
        (obs_dim,), (act_dim,) = env.single_observation_space.shape, env.single_action_space.shape
        sac_cfg = replace(learner_config(cfg, 1), buffer_size=1)  # acting only: no replay ring
        sac = FastSAC(obs_dim, act_dim, 1, sac_cfg, env.device, graphs=False)
        sac.load(checkpoint)
        return torch_policy(lambda obs: sac.act(obs, deterministic=True), env.device)
    model = get_class(cfg.agent._target_).load(checkpoint, device=device_of(cfg))
    return lambda obs: model.predict(obs, deterministic=True)[0]


def record(cfg: DictConfig, act: Act, action_mode: str, split: str, folder: str) -> None:
    """Two episodes of ``split`` (run side by side in two slots) as videos in ``folder``."""
    env = make_env(cfg, 2, autoreset=False, action_mode=action_mode, render_mode="rgb_array")
    obs, _ = env.reset(seed=eval_seed(split, 2))
    frames: list[list] = [[f] for f in env.render()]
    alive = [True, True]
    while any(alive):
        obs, _, term, trunc, _ = env.step(act(obs))
        for i, frame in enumerate(env.render()):
            if alive[i]:
                frames[i].append(frame)
                alive[i] = not bool(term[i] or trunc[i])
    for i, episode in enumerate(frames):
        save_video(episode, folder, fps=env.metadata["render_fps"], episode_index=i)
    env.close()


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    check(cfg)
    checkpoint, video, split = cfg.get("checkpoint"), cfg.get("video"), cfg.get("split", "validation")
    mode = cfg.env.action_mode if checkpoint else "residual"  # the base policy: its own noise, no correction
    env = make_env(cfg, cfg.eval.episodes, autoreset=False, action_mode=mode)
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    act = load_agent(cfg, checkpoint, env) if checkpoint else lambda obs: zeros[: len(obs)]
    res = evaluate(env, act, split, cfg.eval.episodes)
    print(
        json.dumps(
            {
                "checkpoint": checkpoint,
                "split": split,
                "episodes": res.episodes,
                "success": res.success,
                "mean_return": res.mean_return,
            }
        )
    )
    if video:
        record(cfg, act, mode, split, str(video))


if __name__ == "__main__":
    main()
