"""FastSAC: the update against an independent SAC written with torch.distributions, the replay
ring, safetensors state (round trip, all-or-nothing refusal), the captured path on the GPU, and
data parallelism over gloo (two spawned ranks stay identical)."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributions import Normal, TanhTransform

from flashrt_gym.learners.fast_sac import FastSAC, FastSACConfig

OBS, ACT, N = 3, 2, 4
CFG = FastSACConfig(hidden=(8, 8), batch_size=16, buffer_size=32, updates_per_step=1, init_alpha=0.5)


def filled(
    cfg: FastSACConfig = CFG, steps: int = 6, seed: int = 0, device: str = "cpu", data: int = 0, world_size: int = 1
) -> FastSAC:
    """A learner (initialised from ``seed``) whose ring holds ``steps`` env steps of random
    transitions (drawn from ``data``)."""
    sac = FastSAC(OBS, ACT, N, cfg, device, seed=seed, graphs=device != "cpu", world_size=world_size)
    g = torch.Generator().manual_seed(data + 100)
    for _ in range(steps):
        r = lambda *s: (torch.rand(*s, generator=g) * 2 - 1).to(device)  # noqa: E731
        sac.store(r(N, OBS), r(N, ACT), r(N), r(N, OBS), r(N) > -0.5)
    return sac


def reference_update(sac: FastSAC, seed: int, gamma: float) -> dict[str, torch.Tensor]:
    """Parameters, targets and gradients after one SAC step written independently:
    torch.distributions for the squashed Gaussian, each critic as its own slice of the ensemble,
    three separate backward passes and optimizers."""
    c = sac.cfg
    p = {k.removeprefix("param."): sac.bufs[k].clone() for k in sac.bufs.names("shared") if k.startswith("param.")}
    tgt = {k.removeprefix("target."): sac.bufs[k].clone() for k in sac.bufs.names("shared") if k.startswith("target.")}
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    layers = [i for i in range(0, 3 * len(c.hidden), 3)]

    def actor(obs, eps, w):
        h = obs
        for i in layers:
            h = F.linear(h, w[f"actor.trunk.{i}.weight"], w[f"actor.trunk.{i}.bias"])
            h = F.relu(F.layer_norm(h, h.shape[-1:], w[f"actor.trunk.{i + 1}.weight"], w[f"actor.trunk.{i + 1}.bias"]))
        mean = F.linear(h, w["actor.mean.weight"], w["actor.mean.bias"])
        std = F.linear(h, w["actor.log_std.weight"], w["actor.log_std.bias"]).clamp(-20, 2).exp()
        x, tanh = mean + std * eps, TanhTransform(cache_size=1)
        a = tanh(x)
        return a, (Normal(mean, std).log_prob(x) - tanh.log_abs_det_jacobian(x, a)).sum(-1)

    def q(obs, act, w, e):
        h = torch.cat([obs, act], -1)
        for i in layers:
            h = h @ w[f"critic.net.{i}.weight"][e] + w[f"critic.net.{i}.bias"][e]
            ln_w, ln_b = w[f"critic.net.{i + 1}.weight"][e], w[f"critic.net.{i + 1}.bias"][e]
            h = F.relu(F.layer_norm(h, h.shape[-1:]) * ln_w + ln_b)
        last = 3 * len(c.hidden)
        return (h @ w[f"critic.net.{last}.weight"][e] + w[f"critic.net.{last}.bias"][e]).squeeze(-1)

    torch.manual_seed(seed)
    b = sac.bufs
    rows = (torch.rand(c.batch_size, dtype=torch.float64) * b["replay.filled"]).long()
    eps_next, eps = torch.randn(c.batch_size, ACT), torch.randn(c.batch_size, ACT)
    obs, act, rew, nxt, nd = (b[f"replay.{k}"][rows] for k in ("obs", "action", "reward", "next_obs", "not_done"))
    alpha = p["log_alpha"].exp()
    with torch.no_grad():
        a2, lp2 = actor(nxt, eps_next, p)
        tq = {f"critic.{k}": v for k, v in tgt.items()}
        target = rew + gamma * nd * (torch.minimum(q(nxt, a2, tq, 0), q(nxt, a2, tq, 1)) - alpha * lp2)
    critic_loss = sum(0.5 * F.mse_loss(q(obs, act, leaves, e), target) for e in (0, 1))
    a, lp = actor(obs, eps, leaves)
    frozen = {k: v.detach().clone() for k, v in leaves.items()}  # the critics before their step
    actor_loss = (alpha * lp - torch.minimum(q(obs, a, frozen, 0), q(obs, a, frozen, 1))).mean()
    alpha_loss = -(leaves["log_alpha"] * (lp.detach() + c.target_entropy)).mean()
    for group, loss in (("critic.", critic_loss), ("actor.", actor_loss), ("log_alpha", alpha_loss)):
        params = [v for k, v in leaves.items() if k.startswith(group)]
        opt = torch.optim.Adam(params, lr=c.lr)
        opt.zero_grad()
        loss.backward(inputs=params)
        opt.step()
    out = {f"param.{k}": v.detach() for k, v in leaves.items()} | {f"grad.{k}": v.grad for k, v in leaves.items()}
    for k, v in tgt.items():
        out[f"target.{k}"] = torch.lerp(v, out[f"param.critic.{k}"], c.tau)
    return out


@pytest.mark.parametrize("gamma", [0.9, 0.0])
def test_update_is_sac_term_for_term(gamma):
    """Gradients (Adam's first step is sign-like: parameters alone would hide a wrong
    magnitude), parameters and targets after one step equal the reference's; a reference with
    another discount (the mutation) gives other gradients."""
    sac = filled(replace(CFG, gamma=gamma))
    want = reference_update(sac, seed=7, gamma=gamma)
    wrong = reference_update(sac, seed=7, gamma=gamma + 0.05)  # the mutation: another discount
    torch.manual_seed(7)
    sac.update()
    assert sac.updates == 1 and "steps" in sac.graph
    for name, ref in want.items():
        torch.testing.assert_close(sac.bufs[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(sac.bufs["grad.critic.net.0.weight"], wrong["grad.critic.net.0.weight"])
    stats = sac.stats()
    assert set(stats) == {"critic_loss", "actor_loss", "alpha", "entropy", "q"} and stats["alpha"] == pytest.approx(0.5)
    assert sac.stats() == {}  # read and cleared


def test_one_update_call_runs_updates_per_step_whole_steps():
    """One replay of the unrolled graph equals that many single steps (a count short of it,
    the mutation, does not)."""
    arenas = []
    for per_call, calls in ((3, 1), (1, 3), (2, 1)):
        sac = filled(replace(CFG, updates_per_step=per_call))
        torch.manual_seed(1)
        for _ in range(calls):
            sac.update()
        arenas.append(sac.bufs.shared_arena)
    assert torch.equal(arenas[0], arenas[1]) and not torch.equal(arenas[0], arenas[2])


def test_replay_ring_wraps_and_samples_only_stored_rows():
    cfg = replace(CFG, buffer_size=3 * N)  # three env steps of N slots
    sac = FastSAC(OBS, ACT, N, cfg, "cpu")
    for t in range(5):  # steps 0 and 1 are overwritten by 3 and 4
        obs = torch.full((N, OBS), float(t)) + torch.arange(N)[:, None] / 10
        sac.store(obs, torch.zeros(N, ACT), torch.full((N,), float(t)), obs + 100, torch.tensor([1, 0, 1, 1]).bool())
    b = sac.bufs
    assert int(b["replay.pos"]) == 2 and float(b["replay.filled"]) == 3 * N and sac.stored == 5 * N
    assert sorted(set(b["replay.reward"].tolist())) == [2.0, 3.0, 4.0]
    assert torch.equal(b["replay.next_obs"], b["replay.obs"] + 100)
    assert b["replay.not_done"].view(3, N)[:, 1].eq(0).all() and b["replay.not_done"].view(3, N)[:, 0].eq(1).all()
    assert torch.allclose(b["replay.obs"][:N, 0] % 1, torch.arange(N) / 10)  # row = step * N + slot


def test_waits_for_a_batch_before_updating():
    sac = filled(steps=3)  # 12 transitions < batch 16
    sac.update()
    assert sac.updates == 0 and "steps" not in sac.graph
    sac.store(*(torch.zeros(N, d) for d in (OBS, ACT)), torch.zeros(N), torch.zeros(N, OBS), torch.ones(N))
    sac.update()
    assert sac.updates == 1


def test_state_round_trips_through_safetensors(tmp_path):
    sac = filled()
    torch.manual_seed(0)
    sac.update()
    sac.save(tmp_path / "last.safetensors", metadata={"env_steps": 24})
    sac.save(tmp_path / "replay.safetensors", replay=True)
    with open(tmp_path / "last.safetensors", "rb") as f:  # a safetensors header, not a pickle
        assert f.read(9)[8:9] == b"{"
    back = FastSAC(OBS, ACT, N, CFG, "cpu", seed=1)
    assert back.load(tmp_path / "last.safetensors") == {"env_steps": 24}
    assert back.updates == 1 and back.stored == 0
    state = [n for n in back.bufs.names("shared") if n.split(".")[0] in ("param", "target", "adam")]
    n = len([*sac.actor.parameters(), *sac.critic.parameters(), sac.log_alpha])
    assert len(state) == 4 * n + len(list(sac.target.parameters()))  # each parameter with Adam's three; targets
    for n in state:
        assert torch.equal(back.bufs[n], sac.bufs[n]), n
    assert float(back.bufs["replay.filled"]) == 0
    back.load(tmp_path / "replay.safetensors", replay=True)
    assert back.stored == sac.stored and torch.equal(back.bufs["replay.obs"], sac.bufs["replay.obs"])
    torch.manual_seed(3)
    sac.update()
    torch.manual_seed(3)
    back.update()  # the loaded learner continues exactly as the original
    assert torch.equal(back.bufs["param.actor.mean.weight"], sac.bufs["param.actor.mean.weight"])


def test_load_refuses_other_files_and_changes_nothing(tmp_path):
    sac = filled()
    sac.save(tmp_path / "s.safetensors")
    before = sac.bufs.shared_arena.clone()
    other = FastSAC(OBS, ACT, N, replace(CFG, hidden=(8, 4)), "cpu")
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="other sizes.*hidden"):
        sac.load(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="replay"):
        sac.load(tmp_path / "s.safetensors", replay=True)
    save_file({"x": torch.zeros(1)}, tmp_path / "foreign.safetensors")
    with pytest.raises(ValueError, match="not a FastSAC file"):
        sac.load(tmp_path / "foreign.safetensors")
    assert torch.equal(sac.bufs.shared_arena, before)


def test_config_rejects_values_that_cannot_work():
    with pytest.raises(ValueError, match="gamma=1.0"):
        FastSACConfig(gamma=1.0)
    with pytest.raises(ValueError, match="batch_size=0"):
        FastSACConfig(batch_size=0)


def _rank(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    out = {}
    for name, ranks in (("all-reduced", world), ("independent", 1)):  # the second is the mutation
        torch.manual_seed(rank)  # each rank: its own sampling stream
        sac = filled(seed=0, data=rank, world_size=ranks)  # the same init, each rank its own data
        for _ in range(3):
            sac.update()
        state = sac.state_bytes().clone()
        gathered = [torch.zeros_like(state) for _ in range(world)]
        dist.all_gather(gathered, state)
        out[name] = [bool(torch.equal(gathered[0], g)) for g in gathered]
    dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))


def test_two_gloo_ranks_stay_identical(tmp_path):
    """Two spawned ranks, each with its own data: with the gradient all-reduce their parameters
    and Adam state are byte-identical after three updates; without it they differ."""
    mp.start_processes(_rank, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert out[0] == out[1] == {"all-reduced": [True, True], "independent": [True, False]}


@pytest.mark.cuda
def test_captured_update_equals_eager_and_capture_changes_nothing():
    """On the GPU: replays of the captured step follow the eager step from the same state and
    seed, and capturing (warm-up included) leaves the learner's state as it was."""
    cfg = replace(CFG, updates_per_step=4)
    graph, eager = filled(cfg, device="cuda"), filled(cfg, device="cuda")
    eager.graph = type(eager.graph)("eager", backend="eager").bind(eager.bufs)
    before = graph.bufs.shared_arena.clone()
    graph.capture()
    assert torch.equal(graph.bufs.shared_arena, before)
    for sac in (graph, eager):
        torch.cuda.manual_seed(5)
        sac.update()
    for n in graph.bufs.names("shared"):
        torch.testing.assert_close(graph.bufs[n], eager.bufs[n], rtol=1e-4, atol=1e-5, msg=n)
    assert not math.isnan(graph.stats()["critic_loss"])
