"""One training run's record: the progress bar, the run folder (``curve.json``, tensorboard
scalars, ``curve.png``, ``summary.json``), the deadline and the summary with its intervals.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from scipy.stats import binomtest
from tqdm import tqdm

from flashrt.runtime import atomic_write
from flashrt_gym.devices import peak_gpu_memory_mb
from flashrt_gym.evaluation import EvalResult
from flashrt_gym.training.setup import device_of

logger = logging.getLogger(__name__)


def success_interval(success: float, episodes: int) -> tuple[float, float]:
    """The Wilson score 95 % interval of a success rate over independent episodes.

    Args:
        success: the rate observed (successes / episodes).
        episodes: how many episodes it is over.

    Returns:
        ``(low, high)``, the interval's bounds as rates.
    """
    ci = binomtest(round(success * episodes), episodes).proportion_ci(0.95, method="wilson")
    return float(ci.low), float(ci.high)


class Progress:
    """The training loop's tqdm bar over env steps: env steps/s, the ETA and the last validation
    success. Under a time limit the bar's total is the env steps the measured rate reaches by the
    deadline (at most the step budget), so the ETA is the real one.

    Args:
        total: the run's env step budget. initial: env steps already done (a resumed run).
        stop_at: the deadline (``time.time()``), or None. disable: hide the bar (ranks above 0).
    """

    def __init__(self, total: int, initial: int, stop_at: float | None, disable: bool = False) -> None:
        self.total, self.initial, self.stop_at = total, initial, stop_at
        self.t0 = time.time()
        self.bar = tqdm(
            total=total, initial=initial, desc="train", unit="env step", unit_scale=True, disable=disable, smoothing=0.1
        )

    def update(self, env_steps: int) -> None:
        """Move the bar to ``env_steps`` (all ranks together)."""
        now = time.time()
        if self.stop_at is not None and env_steps > self.initial and now > self.t0:
            rate = (env_steps - self.initial) / (now - self.t0)
            self.bar.total = min(self.total, int(env_steps + rate * max(self.stop_at - now, 0.0)))
        self.bar.update(env_steps - self.bar.n)

    def validated(self, success: float) -> None:
        """Show ``success``, the latest validation point's rate, beside the rate and ETA."""
        self.bar.set_postfix(validation=f"{success:.1%}")

    def close(self) -> None:
        """End the bar (before the final evaluation, which shows its own)."""
        self.bar.close()


class RunLog:
    """One run's record on disk: ``curve.json`` (validation points, and test points marked as
    such), tensorboard scalars under ``tb/``, and at the end ``curve.png`` and ``summary.json``.
    A resumed run continues its curve.

    Args:
        cfg: the run's config (``logger.tensorboard``). out: the run folder.
        launch: the job's start (``time.time()``), from which every ``wall_s`` counts.
        base: the base policy's result on each split.
        progress: the bar that shows each validation figure, if any.
    """

    def __init__(
        self, cfg: DictConfig, out: Path, launch: float, base: dict[str, EvalResult], progress: Progress | None = None
    ) -> None:
        self.cfg, self.out, self.launch, self.base, self.progress = cfg, out, launch, base, progress
        self.curve: list[dict[str, Any]] = []
        if (out / "curve.json").is_file():
            self.curve = json.loads((out / "curve.json").read_text())
        self.tb = None
        if cfg.logger.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"))

    def scalars(self, env_steps: int, values: dict[str, float]) -> None:
        """Write ``values`` (tag to value) at ``env_steps`` to tensorboard, if it is on."""
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, env_steps)

    def point(self, env_steps: int, split: str, res: EvalResult, milestone: int | None = None) -> dict[str, Any]:
        """Record one evaluation.

        Args:
            env_steps: when. split: ``validation`` or ``test``. res: its result.
            milestone: the ``eval.test_at`` entry that this point is the first evaluation past.

        Returns:
            The point as written to ``curve.json``.
        """
        base = self.base[split]
        p = {
            "env_steps": int(env_steps),
            "split": split,
            "success": res.success,
            "return": res.mean_return,
            "base_success": base.success,
            "base_return": base.mean_return,
            "episodes": res.episodes,
            "wall_s": time.time() - self.launch,
        }
        if milestone is not None:
            p["milestone"] = int(milestone)
        if split == "test" and res.by_instruction:  # per task on MT10: the per-task table
            p["by_instruction"] = by_instruction(res, base)
        self.curve.append(p)
        tag = "eval" if split == "validation" else "test"
        self.scalars(env_steps, {f"{tag}/success": res.success, f"{tag}/return": res.mean_return})
        text = json.dumps(self.curve, indent=1)
        atomic_write(self.out / "curve.json", lambda f: f.write(text.encode()))
        if self.progress is not None and split == "validation":
            self.progress.validated(res.success)
        logger.info(
            "[%d env steps, %.0f s] %s success %.1f%% (base %.1f%%) on %d starts",
            env_steps, p["wall_s"], split, 100 * res.success, 100 * base.success, res.episodes,
        )  # fmt: skip
        return p

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` and ``curve.png``, close tensorboard and log the headline.

        Args:
            summary: what :func:`summarize` made.

        Returns:
            ``summary``.
        """
        text = json.dumps(summary, indent=2)
        atomic_write(self.out / "summary.json", lambda f: f.write(text.encode()))
        plot_curve(self.curve, self.out / "curve.png", f"{summary['agent'].rsplit('.', 1)[-1]}, seed {summary['seed']}")
        if self.tb is not None:
            self.tb.close()
        (lo, hi), (base_lo, base_hi) = summary["success_ci95"], summary["base_success_ci95"]
        logger.info(
            "base policy success %.1f%% [%.1f, %.1f] -> steered %.1f%% [%.1f, %.1f] on %d test starts "
            "(Wilson 95%% intervals) after %d env steps (%.1f env steps/s), %.0f s",
            100 * summary["base_success"], 100 * base_lo, 100 * base_hi, 100 * summary["success"], 100 * lo,
            100 * hi, summary["test_episodes"], summary["env_steps"], summary["env_steps_per_s"], summary["wall_s"],
        )  # fmt: skip
        return summary


def by_instruction(res: EvalResult, base: EvalResult) -> dict[str, dict[str, float | int]]:
    """Each instruction's success, the base policy's on the same starts beside it, and the
    episodes that began with it (on Meta-World's MT10 an instruction is a task).

    Args:
        res: the steered policy's result. base: the base policy's on the same split.

    Returns:
        Instruction text to ``success``, ``base_success`` and ``episodes``.
    """
    base_rates = base.success_by_instruction()
    return {
        text: {"success": won / n, "base_success": base_rates.get(text), "episodes": n}
        for text, (won, n) in res.by_instruction.items()
    }


def plot_curve(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    """Plot the steered and the base policy's success over env steps (validation lines, test stars).

    Args:
        curve: the run's points (``curve.json``). path: the PNG to write. title: the plot's.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    val = [p for p in curve if p["split"] == "validation"]
    test = [p for p in curve if p["split"] == "test"]
    ax.plot([p["env_steps"] for p in val], [p["success"] for p in val], marker="o", label="steered (validation)")
    ax.plot([p["env_steps"] for p in val], [p["base_success"] for p in val], linestyle="--", label="base policy")
    if test:
        steps = [p["env_steps"] for p in test]
        ax.plot(steps, [p["success"] for p in test], "k*", ms=10, label="steered (test)")
        ax.plot(steps, [p["base_success"] for p in test], "kx", ms=8, label="base policy (test)")
    ax.set(xlabel="env steps (chunks)", ylabel="success rate", ylim=(0, 1), title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def deadline(cfg: DictConfig, launch: float, final_eval_s: float = 0.0) -> float | None:
    """When training stops at the latest.

    Args:
        cfg: the run's config (``time_limit_s``, ``time_limit_includes_eval``).
        launch: the job's start (``time.time()``).
        final_eval_s: the seconds the base policy's evaluation of the same episodes took; with
            ``time_limit_includes_eval`` training stops that much earlier, so that the final
            evaluation also ends within ``time_limit_s``.

    Returns:
        The deadline (``time.time()``), or None without a time limit.
    """
    if cfg.time_limit_s is None:
        return None
    return launch + cfg.time_limit_s - (final_eval_s if cfg.time_limit_includes_eval else 0.0)


def summarize(
    cfg: DictConfig, log: RunLog, env_steps: int, train_s: float, steps_trained: int, **extra: Any
) -> dict[str, Any]:
    """The summary of a finished run: the last test point is the headline.

    Args:
        cfg: the run's config. log: its record. env_steps: env steps at the end.
        train_s: seconds in the training loop. steps_trained: env steps this job trained.
        **extra: more entries (the loop's own).

    Returns:
        The summary (``summary.json``'s content).
    """
    test = [p for p in log.curve if p["split"] == "test"]
    final = test[-1]
    at = {str(p.get("milestone", p["env_steps"])): p["success"] for p in test}
    val = [p for p in log.curve if p["split"] == "validation"]
    return {
        "agent": cfg.agent._target_,
        "seed": cfg.seed,
        "env_steps": int(env_steps),
        "num_envs": cfg.env.num_envs,
        "base_success": final["base_success"],
        "success": final["success"],
        "base_return": final["base_return"],
        "return": final["return"],
        "test_episodes": final["episodes"],
        "success_ci95": success_interval(final["success"], final["episodes"]),
        "base_success_ci95": success_interval(final["base_success"], final["episodes"]),
        "test_success_at": at,
        "test_by_instruction": final.get("by_instruction", {}),
        "validation_success": val[-1]["success"] if val else None,
        "wall_s": time.time() - log.launch,
        "process_cpu_s": time.process_time(),  # every thread's CPU time: with wall_s, how loaded the machine was
        "train_seconds": train_s,
        "env_steps_per_s": steps_trained / train_s if train_s > 0 else 0.0,  # training, validation included
        "env_steps_per_s_from_launch": steps_trained / max(time.time() - log.launch, 1e-9),
        "first_wall_s_validation_90": next((p["wall_s"] for p in val if p["success"] >= 0.9), None),
        "device": device_of(cfg),
        "gpu_memory_MB": peak_gpu_memory_mb(),  # None on the CPU
        **extra,
    }
