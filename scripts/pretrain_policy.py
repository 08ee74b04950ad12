"""Behaviour cloning of the VLA flow policy on expert demonstrations (flow-matching loss).

Reads the shards of scripts/collect_demos.py, trains the chosen preset (from scratch, or from the
weights in ``init`` to fine-tune them on these demonstrations) with AdamW (bf16 autocast on a
GPU), logs the loss to tensorboard, and every ``eval_every`` steps saves a checkpoint and
measures its closed-loop success on seen and held-out instructions (``eval_episodes`` each, the
unsteered policy drawing its own noise, inside the same captured step graph the env uses).
Writes ``<out>/step-<N>/`` weight folders and ``<out>/evals.json``. An update whose gradient
norm is not finite is skipped and counted; ``max_skipped_in_a_row`` of them in a row stop the
run (its weights no longer move), keeping the weights and the batch. The loss runs on SDPA's
flash, memory-efficient and math backends, never cuDNN's (see ``TRAIN_ATTENTION``).

    python scripts/pretrain_policy.py demos=demos steps=6000 out=runs/pretrain
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from flashrt.policies import PRESETS, FlowPolicy, load, save, tokenizer_for
from flashrt.runtime import atomic_write
from flashrt_gym.demos.tabletop import Windows, load_shards
from flashrt_gym.devices import resolve_device
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import VALIDATION_SEED, base_policy
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig

logger = logging.getLogger(__name__)


def evaluate(folder: Path, task_cfg: TabletopConfig, cfg: DictConfig, device: str) -> dict[str, float]:
    """Success rate of the unsteered policy saved in ``folder`` on both instruction splits, from
    the validation starts (checkpoints are chosen on these, never on the test starts)."""
    out = {}
    for split in ("train", "heldout"):
        env = FlashRTVectorEnv(
            cfg.eval_episodes,
            action_mode="residual",
            autoreset=False,
            task=dataclasses.replace(task_cfg, split=split),
            weights=folder,
            device=device,
            n_action_steps=cfg.n_action_steps,
            max_episode_steps=cfg.max_episode_steps,
        )
        out[split] = base_policy(env, VALIDATION_SEED).success
        env.close()
    return out


TRAIN_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's backends for the training loss: all but cuDNN's. On H100/H200, cuDNN's attention
backward returns NaN gradients for masked attention whose rows have a very negative logsumexp
(pytorch/pytorch#196678), which the policy's masked attention meets once its weights are trained
(README: the fine-tuning of the MuJoCo push task's shipped policy)."""


def nonfinite_grads(model: FlowPolicy) -> list[str]:
    """The parameters whose gradient holds a NaN or an infinity, in the model's order (where a
    non-finite gradient first appears points at the operation that made it)."""
    return [name for name, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]


def finite_with_math_attention(model: FlowPolicy, batch: dict, g: torch.Generator, g_state: torch.Tensor) -> bool:
    """Whether the same batch, with the same times and noise, gives finite gradients when every
    attention runs SDPA's math backend (plain autograd): tells a fused attention kernel's backward
    apart from the model's own numbers."""
    g.set_state(g_state)
    model.zero_grad(set_to_none=True)
    cuda = next(model.parameters()).is_cuda
    with sdpa_kernel(SDPBackend.MATH), torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=cuda):
        model.loss(batch, g).backward()
    return not nonfinite_grads(model)


def stuck(
    model: FlowPolicy, folder: Path, idx: torch.Tensor, g_state: torch.Tensor, in_a_row: int, math_finite: bool
) -> None:
    """Stop a run whose updates all have a non-finite gradient norm: its weights no longer move,
    so every later checkpoint would be this one. Saves the weights (float32) and what draws the
    last batch (its window indices, the generator's state before the loss) to study the cause;
    ``math_finite``: whether that batch's gradients are finite with SDPA's math backend."""
    save(model, folder, dtype=torch.float32)
    atomic_write(folder / "batch.pt", lambda f: torch.save({"idx": idx.cpu(), "generator": g_state.cpu()}, f))
    verdict = "finite" if math_finite else "non-finite too"
    raise FloatingPointError(
        f"{in_a_row} updates in a row had a non-finite gradient norm: training no longer moves the weights. "
        f"With SDPA's math backend the last batch's gradients are {verdict}. The weights and the batch are in "
        f"{folder}; lower lr, or raise max_skipped_in_a_row to go on"
    )


def instructions(task_cfg: TabletopConfig) -> list[str]:
    """The demonstrations' instruction texts in their index order (the shards' ``instruction``);
    a script that trains on another simulator's shards sets this name, as it does ``evaluate``."""
    return Tabletop(task_cfg).instructions


def initial_model(cfg: DictConfig, task_cfg: TabletopConfig, device: str) -> FlowPolicy:
    """The preset's model for the demonstrations' task, freshly initialised, or with ``cfg.init``'s
    weights (float32), which must be a model of that same configuration."""
    want = PRESETS[cfg.preset](task_cfg.vocabulary)
    if cfg.init is None:
        return FlowPolicy(want).to(device)
    model, _ = load(cfg.init, device=device)
    if model.cfg != want:
        raise ValueError(
            f"init={cfg.init} holds a model of another configuration than preset={cfg.preset} for these "
            f"demonstrations' task (a different size or vocabulary); start from weights of preset {cfg.preset} "
            "trained on the same instructions, or set init=null"
        )
    return model


def run(cfg: DictConfig) -> dict:
    device = str(resolve_device(cfg.device))
    torch.manual_seed(cfg.seed)
    data, task_cfg = load_shards(cfg.demos)
    model = initial_model(cfg, task_cfg, device)
    text_ids, text_mask = (t.to(device) for t in tokenizer_for(model.cfg).encode(instructions(task_cfg)))
    windows = Windows(
        data, n_obs=model.cfg.n_obs_steps, horizon=model.cfg.horizon, stride=cfg.n_action_steps, device=device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    out = Path(cfg.out)
    writer = SummaryWriter(out / "tb")
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    evals, t0, seen, skipped, in_a_row = [], time.perf_counter(), 0, 0, 0
    params = sum(p.numel() for p in model.parameters())
    logger.info(
        "pretrain: %.1f M parameters, %d windows from %d ticks on %s",
        params / 1e6,
        len(windows),
        len(data["tick"]),
        device,
    )
    bar = tqdm(range(1, cfg.steps + 1), desc="pretrain", unit="step")
    shown: dict[str, str] = {}  # the bar's postfix: the last loss and validation success rates
    cuda = device == "cuda"
    for step in bar:
        model.train()
        idx = torch.randint(len(windows), (cfg.batch_size,), generator=g, device=device)
        g_state = g.get_state()  # the loss draws its times and noise from here
        with sdpa_kernel(TRAIN_ATTENTION), torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model.loss(windows.batch(idx, text_ids, text_mask), g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if torch.isfinite(grad_norm):
            opt.step()
            in_a_row = 0
        else:  # one bad batch must not turn every weight into NaN (seen once at lr 1e-3)
            skipped, in_a_row = skipped + 1, in_a_row + 1
            writer.add_scalar("pretrain/skipped_steps", skipped, step)
            bad = nonfinite_grads(model)
            where = f"non-finite gradients in {len(bad)} tensors, first {bad[:3]}"
            logger.warning("step %d: update skipped (%d so far), %s", step, skipped, where)
            if in_a_row >= cfg.max_skipped_in_a_row:
                math_finite = finite_with_math_attention(model, windows.batch(idx, text_ids, text_mask), g, g_state)
                stuck(model, out / f"nonfinite-step-{step}", idx, g_state, in_a_row, math_finite)
        sched.step()
        seen += cfg.batch_size
        if step % 50 == 0 or step == cfg.steps:
            writer.add_scalar("pretrain/loss", loss.item(), step)
            writer.add_scalar("pretrain/grad_norm", grad_norm.item(), step)
            writer.add_scalar("pretrain/lr", sched.get_last_lr()[0], step)
            writer.add_scalar("pretrain/samples_per_s", seen / (time.perf_counter() - t0), step)
            shown["loss"] = f"{loss.item():.4f}"
            bar.set_postfix(shown)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            folder = save(model, out / f"step-{step}", dtype=torch.bfloat16)
            rates = evaluate(folder, task_cfg, cfg, device)
            evals.append({"step": step, "weights": str(folder), **{f"success_{k}": v for k, v in rates.items()}})
            for k, v in rates.items():
                writer.add_scalar(f"eval/success_{k}", v, step)
            writer.flush()
            rate_text = ", ".join(f"success {k} {v:.3f}" for k, v in rates.items())
            logger.info("step %d: loss %.4f, %s, %d updates skipped", step, loss.item(), rate_text, skipped)
            shown |= {f"val_{k}": f"{v:.1%}" for k, v in rates.items()}
            bar.set_postfix(shown)
            summary = {
                "parameters": params,
                "seconds": time.perf_counter() - t0,
                "skipped_steps": skipped,
                "evals": evals,
                "config": dict(cfg),
            }
            text = json.dumps(summary, indent=2, default=str)
            atomic_write(out / "evals.json", lambda f, text=text: f.write(text.encode()))  # kept after a stop too
    writer.close()
    return summary


@hydra.main(version_base="1.3", config_path="../configs", config_name="pretrain")
def main(cfg: DictConfig) -> None:
    with logging_redirect_tqdm():  # log lines above the progress bar; Hydra's pretrain_policy.log keeps them
        run(cfg)


if __name__ == "__main__":
    main()
