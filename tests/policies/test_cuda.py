"""The policy under CUDA graph replay (run on the GPU machine: pytest -m cuda)."""

import contextlib

import pytest
import torch

from flashrt import kernels
from flashrt.policies import FlowPolicy, PolicyPipeline, pi0, policy_specs, tiny, tokenizer_for
from flashrt.runtime import BufferSet, restore, snapshot
from flashrt_gym.tasks import TabletopConfig
from tests.policies.small import capture

pytestmark = pytest.mark.cuda


def make(cfg, n: int, model: FlowPolicy | None = None) -> PolicyPipeline:
    if model is None:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = FlowPolicy(cfg).to(torch.bfloat16)
    bufs = BufferSet(policy_specs(model), n, "cuda", deployment="cuda-test")
    p = PolicyPipeline(model, bufs)
    ids, mask = tokenizer_for(cfg).encode(["push the red square to the left goal"] * n)
    bufs["policy.text_ids"].copy_(ids)
    bufs["policy.text_mask"].copy_(mask)
    bufs["policy.rng_key"].copy_(torch.arange(n))
    p.begin_episode()
    return p


def feed(p: PolicyPipeline, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    p["image"].copy_(torch.randint(0, 256, p["image"].shape, generator=g, device="cuda", dtype=torch.uint8))
    p["proprio"].copy_(torch.rand(p["proprio"].shape, generator=g, device="cuda") * 2 - 1)


@pytest.mark.parametrize(("preset", "n"), [("tiny", 8), ("tiny", 1), ("pi0", 1)])
def test_eager_and_graph_replay_are_byte_identical(preset, n):
    cfg = {"tiny": tiny, "pi0": pi0}[preset](TabletopConfig().vocabulary)
    eager = make(cfg, n)
    graph = make(cfg, n, eager.model)
    run = capture(graph)
    eager.encode_instruction()
    run("encode_instruction")
    for step in range(3):
        feed(eager, step)
        feed(graph, step)
        eager.encode_observation()
        eager.draw_noise()
        eager.denoise()
        run("encode_observation")
        run("draw_noise")
        run("denoise")
        torch.cuda.synchronize()
        assert torch.equal(eager.bufs.slot_arena, graph.bufs.slot_arena), f"step {step}"
        assert torch.isfinite(graph["actions"]).all()


def test_snapshot_restore_between_replays_gives_identical_actions():
    p = make(tiny(TabletopConfig().vocabulary), 16)
    run = capture(p)
    run("encode_instruction")
    for step in range(2):
        feed(p, step)
        run("encode_observation")
    cap = snapshot(p.bufs)
    run("draw_noise")
    run("denoise")
    want = p["actions"].clone()
    feed(p, 9)
    run("encode_observation")
    restore(p.bufs, cap)
    run("draw_noise")
    run("denoise")
    assert torch.equal(p["actions"], want)


@pytest.mark.parametrize("n", [1, 300])
def test_fused_kernels_agree_with_the_references(n):
    """The policy step with the Triton kernels (one-token and blocked launch shapes) against the
    same step with every kernel's torch reference: bf16 throughout, so to rounding (a wiring
    mistake is O(1))."""
    cfg = tiny(TabletopConfig().vocabulary)
    fused = make(cfg, n)
    ref = make(cfg, n, fused.model)
    z = torch.randn(fused["noise"].shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for p, reference in ((fused, False), (ref, True)):
        with kernels.reference_only() if reference else contextlib.nullcontext():
            p.encode_instruction()
            for step in range(2):
                feed(p, step)
                p.encode_observation()
            p["noise"].copy_(z)
            p.denoise()
    for name in ("kv_text", "kv_obs", "actions"):
        got, want = fused[name].float(), ref[name].float()
        assert (got - want).norm() < 0.03 * want.norm(), name
