"""Evaluation, ``flashrt-eval``: a trained agent, or the unsteered base policy, on FlashRT-VLA's
evaluation starts (Hydra app over the same config groups as the main job).

    flashrt-eval +checkpoint=outputs/<run>/checkpoints/last.safetensors   # FastSAC
    flashrt-eval agent=sac +checkpoint=outputs/<run>/checkpoints/last.zip # an SB3 agent
    flashrt-eval                                   # the base policy alone
    flashrt-eval +split=test +video=videos/        # the test starts; two episodes as videos
    flashrt-eval +checkpoint=<...> +video=videos/  # base beside steered, and strip.png
    flashrt-eval base_eval=out/base_eval.json      # the base policy on both splits, into a file

The split is ``validation`` unless ``+split=test`` (flashrt_gym.splits). Prints one JSON line.
With ``base_eval=FILE`` and no checkpoint, the base policy runs ``eval.episodes`` validation and
``eval.test_episodes`` test episodes and FILE keeps them (read back if it already holds them):
the runs of one job given ``base_eval=FILE`` then read it instead of each evaluating the same
base policy again (:func:`flashrt_gym.training.setup.base_evaluation`); the line printed is
``+split``'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import hydra
import matplotlib.pyplot as plt
import numpy as np
from hydra.utils import get_class
from omegaconf import DictConfig

from flashrt.runtime import atomic_write
from flashrt_gym.cli import CONFIGS
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import evaluate, torch_policy
from flashrt_gym.splits import eval_seed
from flashrt_gym.training import check, device_of, loop_of, make_env
from flashrt_gym.training.device_loop import load_learner
from flashrt_gym.training.setup import base_evaluation

Act = Callable[[np.ndarray], np.ndarray]


def load_agent(cfg: DictConfig, checkpoint: str, env: FlashRTVectorEnv) -> Act:
    """The deterministic policy of ``checkpoint``.

    Args:
        cfg: the job's config (its ``agent`` group says which learner wrote the checkpoint).
        checkpoint: a device learner's file (FastSAC's safetensors), or an SB3 zip (a pickle:
            trusted files only).
        env: the env the policy will act in (its spaces and device).

    Returns:
        A function from a batch of observations to a batch of actions.
    """
    if loop_of(cfg) == "device":
        (obs_dim,), (act_dim,) = env.single_observation_space.shape, env.single_action_space.shape
        learner = load_learner(cfg, checkpoint, obs_dim, act_dim, env.device)
        return torch_policy(lambda obs: learner.act(obs, deterministic=True), env.device)
    model = get_class(cfg.agent._target_).load(checkpoint, device=device_of(cfg))
    return lambda obs: model.predict(obs, deterministic=True)[0]


def episodes(cfg: DictConfig, act: Act | None, action_mode: str, seed: int) -> list[list[np.ndarray]]:
    """The rendered frames of two episodes from ``reset(seed=seed)`` (two slots side by side).

    Args:
        cfg: the job's config. act: the agent (None: zero actions). action_mode: the env's.
        seed: the seed of the two starts.

    Returns:
        Per episode, its frames from the first to the last.
    """
    env = make_env(cfg, 2, autoreset=False, action_mode=action_mode, render_mode="rgb_array")
    obs, _ = env.reset(seed=seed)
    zeros = np.zeros(env.action_space.shape, np.float32)
    frames: list[list[np.ndarray]] = [[f] for f in env.render()]
    alive = [True, True]
    while any(alive):
        obs, _, term, trunc, _ = env.step(zeros if act is None else act(obs))
        for i, frame in enumerate(env.render()):
            if alive[i]:
                frames[i].append(frame)
                alive[i] = not bool(term[i] or trunc[i])
    env.close()
    return frames


def join(images: list[np.ndarray], axis: int) -> np.ndarray:
    """``images`` joined along ``axis`` (1: side by side, 0: stacked), a white band between.

    Args:
        images: uint8 images of one shape. axis: 1 joins side by side, 0 stacks.

    Returns:
        The joined image.
    """
    shape = list(images[0].shape)
    shape[axis] = 4
    parts = [images[0]]
    for image in images[1:]:
        parts += [np.full(shape, 255, np.uint8), image]
    return np.concatenate(parts, axis)


def record(cfg: DictConfig, steered: Act | None, action_mode: str, split: str, folder: str) -> None:
    """Two episodes of ``split`` as videos in ``folder``: the base policy's, or, with an agent,
    the base policy (left) beside the steered one (right) from the same starts (the shorter
    episode holds its last frame), and ``strip.png``: six frames of the first start, the base
    policy's row above the steered one's.

    Args:
        cfg: the job's config. steered: the agent, or None for the base policy alone.
        action_mode: the agent's action mode. split: the starts' split. folder: where the files go.
    """
    from gymnasium.utils.save_video import save_video  # needs moviepy (the dev extra)

    seed, fps = eval_seed(split, 2), FlashRTVectorEnv.metadata["render_fps"]
    base = episodes(cfg, None, "residual", seed)  # the VLA on its own noise, uncorrected
    if steered is None:
        for i, frames in enumerate(base):
            save_video(frames, folder, fps=fps, episode_index=i, name_prefix="base")
        return
    agent = episodes(cfg, steered, action_mode, seed)
    for i, (left, right) in enumerate(zip(base, agent, strict=True)):
        n = max(len(left), len(right))
        frames = [join([left[min(t, len(left) - 1)], right[min(t, len(right) - 1)]], 1) for t in range(n)]
        save_video(frames, folder, fps=fps, episode_index=i, name_prefix="base-vs-steered")
    picks = [np.linspace(0, len(e) - 1, 6).round().astype(int) for e in (base[0], agent[0])]
    image = join([join([e[t] for t in ts], 1) for e, ts in zip((base[0], agent[0]), picks, strict=True)], 0)
    atomic_write(Path(folder) / "strip.png", lambda f: plt.imsave(f, image, format="png"))


@hydra.main(version_base="1.3", config_path=CONFIGS, config_name="train")
def main(cfg: DictConfig) -> None:
    """Evaluate ``+checkpoint`` (or the base policy) on ``+split`` and print the result as one JSON line."""
    check(cfg)
    checkpoint, video, split = cfg.get("checkpoint"), cfg.get("video"), cfg.get("split", "validation")
    mode = cfg.env.action_mode if checkpoint else "residual"  # the base policy: its own noise, no correction
    env = make_env(cfg, cfg.eval.episodes, autoreset=False, action_mode=mode)
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    act = load_agent(cfg, checkpoint, env) if checkpoint else lambda obs: zeros[: len(obs)]
    if cfg.get("base_eval") and not checkpoint:
        splits = {"validation": cfg.eval.episodes, "test": cfg.eval.test_episodes}
        res = base_evaluation(cfg, splits, env.engine.bufs.deployment, env=env)[0][split]
    else:
        res = evaluate(env, act, split, cfg.eval.episodes)
    print(
        json.dumps(
            {
                "checkpoint": checkpoint,
                "split": split,
                "episodes": res.episodes,
                "success": res.success,
                "mean_return": res.mean_return,
                "success_by_instruction": res.success_by_instruction(),  # a task each on MT10
            }
        )
    )
    if video:
        record(cfg, act if checkpoint else None, mode, split, str(video))
