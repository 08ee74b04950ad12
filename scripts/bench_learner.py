"""Gradient steps per second: FastSAC's captured update beside TorchRL's ``SACLoss`` update (the
well-kept library's SAC, replay in a ``LazyTensorStorage`` on the device, the update wrapped in
``tensordict.nn.CudaGraphModule`` on CUDA, as LeanRL does), at the same networks and batch.

Both learners get the env's sizes (state observation 15, noise action 16), LayerNorm MLPs of
``--hidden`` widths, twin critics, automatic entropy, Adam, the Polyak update every step, and the
same replay contents. A step of each includes drawing its batch from the replay.

    python scripts/bench_learner.py --out bench_learner.json            # on the GPU
    python scripts/bench_learner.py --batch 256 --steps 20 --hidden 64 64  # a CPU smoke
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchlib import provenance
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from flashrt_gym.learners.fast_sac import FastSAC, FastSACConfig

OBS, ACT = 15, 16


class OpCount(TorchDispatchMode):
    """Counts the aten operations dispatched (forward and backward): about the kernels a
    captured step launches."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(step: Callable[[], object]) -> int:
    with OpCount() as count:
        step()
    return count.n


def timed(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """Gradient steps per second of ``step`` (each call one step), after three warm-up calls."""
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t)


def replay_data(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: (torch.rand(*s, generator=g) * 2 - 1).to(device)  # noqa: E731
    return {"obs": r(n, OBS), "action": r(n, ACT), "reward": r(n), "next_obs": r(n, OBS), "done": r(n) > 0.9}


def fast_sac(hidden: list[int], batch: int, data: dict, device: torch.device, steps: int) -> tuple[float, int]:
    """(gradient steps/s, aten ops per step)."""
    n = len(data["obs"])
    cfg = FastSACConfig(hidden=tuple(hidden), batch_size=batch, buffer_size=n, updates_per_step=1)
    sac = FastSAC(OBS, ACT, n, cfg, device)
    sac.store(data["obs"], data["action"], data["reward"], data["next_obs"], ~data["done"])
    return timed(sac.update, steps, device), ops_per_step(sac.local_updates)


def torchrl_sac(hidden: list[int], batch: int, data: dict, device: torch.device, steps: int) -> tuple[float, int]:
    """(gradient steps/s, aten ops per step)."""
    from tensordict import TensorDict
    from tensordict.nn import CudaGraphModule, TensorDictModule
    from tensordict.nn.distributions import NormalParamExtractor
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import SACLoss, SoftUpdate

    def mlp(d_in: int, d_out: int) -> MLP:
        norms = [{"normalized_shape": h} for h in hidden]
        return MLP(d_in, d_out, num_cells=hidden, norm_class=nn.LayerNorm, norm_kwargs=norms, device=device)

    actor = ProbabilisticActor(
        TensorDictModule(nn.Sequential(mlp(OBS, 2 * ACT), NormalParamExtractor()), ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )
    qvalue = ValueOperator(mlp(OBS + ACT, 1), in_keys=["observation", "action"])
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, loss_function="l2", alpha_init=1.0, target_entropy=0.0)
    loss.make_value_estimator(gamma=0.9)
    target = SoftUpdate(loss, tau=0.005)
    cuda = device.type == "cuda"
    opt = torch.optim.Adam(loss.parameters(), lr=torch.tensor(3e-4, device=device), capturable=cuda)
    n = len(data["obs"])
    rb = ReplayBuffer(storage=LazyTensorStorage(n, device=device), batch_size=batch)
    rb.extend(
        TensorDict(
            {
                "observation": data["obs"],
                "action": data["action"],
                "next": {
                    "observation": data["next_obs"],
                    "reward": data["reward"][:, None],
                    "done": data["done"][:, None],
                    "terminated": data["done"][:, None],
                },
            },
            batch_size=[n],
            device=device,
        )
    )

    def update(td: TensorDict) -> TensorDict:
        opt.zero_grad(set_to_none=False)
        out = loss(td)
        (out["loss_actor"] + out["loss_qvalue"] + out["loss_alpha"]).backward()
        opt.step()
        target.step()
        return out.detach()

    ops = ops_per_step(lambda: update(rb.sample()))
    if cuda:
        update = CudaGraphModule(update, warmup=3)
    return timed(lambda: update(rb.sample()), steps, device), ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 256, 256])
    ap.add_argument("--batch", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--replay", type=int, default=1 << 18, help="transitions in the replay")
    ap.add_argument("--out", type=Path, default=Path("bench_learner.json"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_float32_matmul_precision("high")
    data = replay_data(args.replay, device)
    rows = []
    for batch in tqdm(args.batch, desc="batch sizes", unit="size"):
        row: dict[str, float | str] = {"batch": batch}
        row["fast_sac_steps_per_s"], row["fast_sac_ops"] = fast_sac(args.hidden, batch, data, device, args.steps)
        try:
            row["torchrl_steps_per_s"], row["torchrl_ops"] = torchrl_sac(args.hidden, batch, data, device, args.steps)
            row["speedup"] = row["fast_sac_steps_per_s"] / row["torchrl_steps_per_s"]
        except Exception as e:  # recorded, not hidden: the comparison then says why it is missing
            row["torchrl_error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print(row, flush=True)
    where = provenance() if device.type == "cuda" else {"torch": torch.__version__}
    result = {"provenance": where, "device": str(device), "hidden": args.hidden, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nSAC gradient steps/s, hidden {args.hidden} ({device})")
    print(f"{'batch':>7} {'FastSAC':>9} {'TorchRL':>9} {'speed-up':>9}")
    nan = float("nan")
    for r in rows:
        fast, trl, up = r["fast_sac_steps_per_s"], r.get("torchrl_steps_per_s", nan), r.get("speedup", nan)
        print(f"{r['batch']:>7} {fast:>9.0f} {trl:>9.0f} {up:>8.1f}x")


if __name__ == "__main__":
    main()
