"""How far can steering the VLA's noise go? Search over noise with fork, against the baselines.

Noise-space RL (``scripts/train.py``) learns a policy over the VLA's initial diffusion noise.
This script measures how much that lever can move success on a task (``--task``, a file of
``configs/task/``: the built-in tabletop by default, or the MuJoCo push task), without learning:
every episode runs in a group of K slots that share one boundary; each step the slots try K
noise chunks (the first is zero noise, the policy's mode; the others are drawn
from N(0, I)), run ``lookahead`` steps (zero noise after the first), and the group continues
from its best slot (success first, then summed dense reward) by ``fork``: a byte copy of that
slot's whole state into the other K-1 slots. Beside it, in the same run and on the same starts
(the test starts, which no choice was made on), fixed noise laws: N(0, I) (the base policy),
zero (its mode), the corners of the action box (what a saturated tanh actor emits), and
N(0, c^2 I) for each ``--scales`` c.

Meta-World's MT10 (``--task metaworld_mt10``): episode g runs task g % 10 under every law, and a
group's K slots are one task's (the search env's slots come in runs of K, ``block=K``), since a
row forks only between slots of one task; the result holds each task's rates too.

    python scripts/steer_search.py --episodes 64 --candidates 8 --lookahead 1
    python scripts/steer_search.py --task mujoco_warp_push   # its shipped policy; --weights for another
    python scripts/steer_search.py --task metaworld_mt10 --episodes 512 processes=16  # task keys as key=value
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from benchlib import provenance
from omegaconf import OmegaConf
from tqdm import tqdm

from flashrt.runtime import atomic_write
from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.devices import resolve_device
from flashrt_gym.evaluation import TEST_SEED
from flashrt_gym.training import task_kwargs

TASKS = Path(__file__).resolve().parents[1] / "configs" / "task"


def by_instruction(env: FlashRTVectorEnv, success: np.ndarray, instruction: np.ndarray) -> dict[str, float]:
    """Each instruction's success rate over the episodes that began with it (``instruction``: the
    indices the episodes began with, one an episode)."""
    return {text: float(success[instruction == i].mean()) for i, text in enumerate(env.instructions) if
            (instruction == i).any()}  # fmt: skip


def rollout(env: FlashRTVectorEnv, draw: Callable[[int, int], torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Success of one episode per slot, the noise of every step drawn by ``draw(n, dim)``, and the
    instruction each began with."""
    _, info = env.reset(seed=TEST_SEED)
    n, dim = env.num_envs, env.single_action_space.shape[0]
    success, alive = np.zeros(n, bool), np.ones(n, bool)
    while alive.any():
        _, _, term, trunc, _ = env.step((draw(n, dim) / env.config.noise_bound).clamp(-1, 1).numpy())
        success |= term & alive
        alive &= ~(term | trunc)
    return success, info["instruction"]


def search(env: FlashRTVectorEnv, k: int, lookahead: int, gen: torch.Generator) -> tuple[np.ndarray, int, np.ndarray]:
    """Greedy search with fork: one episode per group of ``k`` slots. Returns the success of
    each group, the env steps it took (all slots) and the instruction each group began with."""
    n, dim = env.num_envs, env.single_action_space.shape[0]
    groups = n // k
    # group g's k slots all start where a laws' episode g starts: from seed TEST_SEED + g
    _, info = env.reset(seed=[TEST_SEED + g for g in range(groups) for _ in range(k)])
    success, done = np.zeros(groups, bool), np.zeros(groups, bool)
    steps = 0
    bar = tqdm(total=groups, desc=f"search, K={k}", unit="episode")
    while not done.all():
        z = torch.randn(n, dim, generator=gen)
        z[::k] = 0.0  # candidate 0 of every group: the policy's mode
        score = np.zeros(n)
        hit, ended = np.zeros(n, bool), np.zeros(n, bool)
        for h in range(lookahead):
            a = z if h == 0 else torch.zeros(n, dim)
            _, reward, term, trunc, _ = env.step((a / env.config.noise_bound).clamp(-1, 1).numpy())
            steps += n
            score += reward * ~ended
            hit |= term & ~ended
            ended |= term | trunc
        score += 1e3 * hit
        for g in np.flatnonzero(~done):
            best = g * k + int(np.argmax(score[g * k : (g + 1) * k]))
            if hit[best] or ended[best]:
                success[g], done[g] = hit[best], True
                bar.update(1)
            else:
                env.fork(best, [s for s in range(g * k, (g + 1) * k) if s != best])
        bar.set_postfix(env_steps=steps, success=f"{success.sum()}/{done.sum()}")
    bar.close()
    return success, steps, info["instruction"][::k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="tabletop", choices=sorted(f.stem for f in TASKS.glob("*.yaml")))
    ap.add_argument(
        "--weights", default=None, help="the policy's weight folder (default: the shipped tiny policy of the task)"
    )
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--candidates", type=int, default=8, help="noise chunks tried per step (K)")
    ap.add_argument("--lookahead", type=int, default=1, help="steps run before choosing (zero noise after the first)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scales", type=float, nargs="*", default=[], help="also run N(0, c^2 I) noise for these c")
    ap.add_argument("--out", type=Path, default=Path("steer_search.json"))
    ap.add_argument("overrides", nargs="*", help="the task config's keys as key=value (processes=16, ...)")
    args = ap.parse_args()
    if args.candidates < 2 or args.lookahead < 1 or args.episodes < 1:
        raise SystemExit("need --candidates >= 2, --lookahead >= 1 and --episodes >= 1")
    gen = torch.Generator().manual_seed(args.seed)
    args.device = str(resolve_device(args.device))
    task = OmegaConf.load(TASKS / f"{args.task}.yaml")
    absent = object()
    bad = [o for o in args.overrides if OmegaConf.select(task, o.partition("=")[0], default=absent) is absent]
    bad += [o for o in args.overrides if "=" not in o and o not in bad]
    if bad:
        raise SystemExit(f"bad task override in {bad}: each is key=value of a key of configs/task/{args.task}.yaml")
    task.merge_with_dotlist(args.overrides)
    task = OmegaConf.to_container(task, resolve=True)
    kw = {"device": args.device, "autoreset": False, "reward_mode": "dense", "weights": args.weights}
    t = time.perf_counter()
    base = FlashRTVectorEnv(args.episodes, **kw, **task_kwargs(task))
    bound = base.config.noise_bound
    baselines: dict[str, Callable[[int, int], torch.Tensor]] = {
        "base_success": lambda n, d: torch.randn(n, d, generator=gen),  # the VLA's own noise law
        "zero_noise_success": lambda n, d: torch.zeros(n, d),  # its mode
        "saturated_noise_success": lambda n, d: torch.randn(n, d, generator=gen).sign() * bound,
    }
    for c in args.scales:
        baselines[f"normal_x{c:g}_success"] = lambda n, d, c=c: c * torch.randn(n, d, generator=gen)
    result = {**provenance(), "command": " ".join(["python scripts/steer_search.py", *sys.argv[1:]])}
    result |= {"task": args.task, "overrides": args.overrides, "weights": args.weights}
    result |= {"episodes": args.episodes, "candidates": args.candidates, "lookahead": args.lookahead}
    result |= {"device": args.device, "by_instruction": {}}
    for name, draw in tqdm(baselines.items(), desc="noise laws", unit="law"):
        success, instruction = rollout(base, draw)
        result[name], result["by_instruction"][name] = float(success.mean()), by_instruction(base, success, instruction)
    base.close()
    if "block" in task:  # Meta-World: a group's slots are one task's, as forks need
        task["block"] = args.candidates
    env = FlashRTVectorEnv(args.episodes * args.candidates, **kw, **task_kwargs(task))
    success, steps, instruction = search(env, args.candidates, args.lookahead, gen)
    result["by_instruction"]["search_success"] = by_instruction(env, success, instruction)
    env.close()
    result.update(search_success=float(success.mean()), search_env_steps=steps, seconds=time.perf_counter() - t)
    text = json.dumps(result, indent=2)
    atomic_write(args.out, lambda f: f.write(text.encode()))
    print(f"{args.episodes} episodes on {args.device}, success by how the noise is chosen:")
    for name in [*baselines, "search_success"]:
        print(f"  {name.removesuffix('_success'):>16}  {result[name]:.1%}")
    search_kind = f"K={args.candidates}, lookahead {args.lookahead}"
    print(f"(search with fork: {search_kind}, {steps} env steps; {result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
