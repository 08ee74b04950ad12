"""The policy under CUDA graph replay, and a policy step with the kernels against the same step
with the torch references (run on the GPU machine: pytest -m cuda). The comparison's CPU
counterpart runs everywhere: it checks on the same model and inputs that the comparison passes
bf16 rounding and fails every mutation."""

import contextlib
from collections.abc import Callable

import pytest
import torch

from flashrt import kernels
from flashrt.policies import FlowPolicy, PolicyPipeline, pi0, policy_specs, tiny, tokenizer_for
from flashrt.runtime import BufferSet, restore, snapshot
from flashrt_gym.sims.tabletop import TabletopConfig
from tests.policies.small import capture

SEGMENTS = {"text": ("kv_text", "text_mask"), "ring": ("kv_ring", "ring_valid"), "obs": ("kv_obs", "obs_valid")}
"""The expert's context segments: each one's keys/values buffer and its mask buffer."""

KV_TOLERANCE, ACTION_TOLERANCE = 0.04, 0.1
"""Most a buffer may deviate from the reference, as a share of its norm per slot; the actions
as a share of what denoising changed (``actions - noise``). On :func:`sharpened` ``tiny`` (1 to
40 slots) the bf16 references deviate from the float32 ones by 0.009 at most in the keys/values
and 0.022 in the actions; the mutations by 0.12 (a frame encoded without its instruction) to
0.97 (the instruction attending to its padding) in the keys/values, by 1.2 to 1.9 in the actions
(the only attended segment, or all three, dropped). At the initial weights a dropped segment
moved the actions by 1.2 to 3.6 % of their norm: a 3 % tolerance on the norm could not see it."""


def sharpened(model: FlowPolicy) -> FlowPolicy:
    """``model`` with its prefix layers made to matter (in place): queries x8 attend sharply,
    output and down projections x10 make each layer change its residual stream by about its own
    size. A frame's keys/values then depend on its context: without the instruction they move by
    0.12 to 0.19 of their norm (at the initial std 0.02 weights by 0.025, near bf16 rounding)."""
    with torch.no_grad():
        for layer in model.prefix:
            layer.q.weight.mul_(8.0)
            layer.o.weight.mul_(10.0)
            layer.down.weight.mul_(10.0)
    return model


def tiny_model(device: str, dtype: torch.dtype = torch.bfloat16, sharp: bool = False) -> FlowPolicy:
    """``tiny`` with seed-0 weights (made on the CPU: the same numbers on every device)."""
    torch.manual_seed(0)
    model = FlowPolicy(tiny(TabletopConfig().vocabulary))
    return (sharpened(model) if sharp else model).to(device, dtype)


def make(cfg, n: int, model: FlowPolicy | None = None) -> PolicyPipeline:
    """A pipeline of ``n`` slots over ``model`` (default: seed-0 random weights, bf16 on the GPU)."""
    if model is None:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = FlowPolicy(cfg).to(torch.bfloat16)
    device = next(model.parameters()).device
    bufs = BufferSet(policy_specs(model), n, device, deployment="test")
    p = PolicyPipeline(model, bufs)
    ids, mask = tokenizer_for(cfg).encode(["push the red square to the left goal"] * n)
    bufs["policy.text_ids"].copy_(ids)
    bufs["policy.text_mask"].copy_(mask)
    bufs["policy.rng_key"].copy_(torch.arange(n))
    p.begin_episode()
    return p


def feed(p: PolicyPipeline, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    p["image"].copy_(torch.randint(0, 256, p["image"].shape, generator=g, dtype=torch.uint8))
    p["proprio"].copy_(torch.rand(p["proprio"].shape, generator=g) * 2 - 1)


@pytest.mark.cuda
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


@pytest.mark.cuda
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


# -- a policy step with the kernels against the same step with the references -------------------


def relative_error(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor | None = None) -> float:
    """Largest over slots of ``|got - want| / max(|want - base|, |got - base|)`` (base 0 if None)."""
    norm = lambda t: t.float().flatten(1).norm(dim=1)  # noqa: E731
    b = torch.zeros_like(want) if base is None else base
    return (norm(got - want) / torch.maximum(norm(want - b), norm(got - b))).max().item()


def assert_agrees(name: str, got: torch.Tensor, want: torch.Tensor, base: torch.Tensor | None = None) -> None:
    """The comparison of :func:`check_step`: ``got`` within the tolerance of ``want`` (the
    actions, given the noise as ``base``: :data:`ACTION_TOLERANCE`; else :data:`KV_TOLERANCE`)."""
    assert torch.isfinite(got).all(), f"{name}: not finite"
    err, tolerance = relative_error(got, want, base), KV_TOLERANCE if base is None else ACTION_TOLERANCE
    assert err < tolerance, f"{name}: deviates by {err:.4f} (tolerance {tolerance})"


def assert_rejects(name: str, got: torch.Tensor, wrong: torch.Tensor, base: torch.Tensor | None = None) -> None:
    """Mutation check: the comparison that passed ``got`` fails against a wrong computation."""
    try:
        assert_agrees(name, got, wrong, base)
    except AssertionError:
        return
    pytest.fail(f"the comparison passed a wrong computation ({name})")


def encoded(model: FlowPolicy, n: int, *, text_unmasked: bool = False, frame_without_text: bool = False):
    """A pipeline after the instruction and two frames. Mutations: ``text_unmasked`` encodes the
    instruction attending to its padding; ``frame_without_text`` encodes the frames with the
    instruction dropped from their context."""
    p = make(model.cfg, n, model)
    mask = p["text_mask"].clone()
    if text_unmasked:
        p["text_mask"].fill_(True)
    p.encode_instruction()
    p["text_mask"].copy_(mask)
    for step in range(2):
        feed(p, step)
        if frame_without_text:
            p["text_mask"].zero_()
        p.encode_observation()
        p["text_mask"].copy_(mask)
    return p


def segment_actions(p: PolicyPipeline, noise: torch.Tensor, keep: str | None, dropped: tuple[str, ...] = ()):
    """The actions from ``noise`` with only segment ``keep`` attended (every segment if None);
    a mutation zeroes the keys/values of the ``dropped`` segments. Leaves the buffers as found."""
    saved = {name: p[name].clone() for kv, m in SEGMENTS.values() for name in (kv, m)}
    for seg, (kv, m) in SEGMENTS.items():
        if keep is not None and seg != keep:
            p[m].zero_()
        if seg in dropped:
            p[kv].zero_()
    p["noise"].copy_(noise)
    p.denoise()
    for name, value in saved.items():
        p[name].copy_(value)
    return p["actions"].clone()


def check_step(
    got_model: FlowPolicy,
    want_model: FlowPolicy,
    n: int,
    got_mode: Callable[[], contextlib.AbstractContextManager],
    want_mode: Callable[[], contextlib.AbstractContextManager],
) -> None:
    """The policy step of ``got_model`` under ``got_mode`` against ``want_model``'s under
    ``want_mode``, buffer by buffer and segment by segment, each comparison beside its mutation:
    keys/values of the instruction (mutation: attending to its padding) and of both frames
    (mutation: encoded without the instruction); the actions over every segment (mutation: all
    three dropped) and over each segment alone (mutation: that segment dropped)."""
    with got_mode():
        got = encoded(got_model, n)
    with want_mode():
        want = encoded(want_model, n)
        unmasked = encoded(want_model, n, text_unmasked=True)
        without_text = encoded(want_model, n, frame_without_text=True)
    for name in ("kv_text", "kv_ring", "kv_obs"):
        assert_agrees(name, got[name], want[name])
    assert_rejects("kv_text, the instruction attending to its padding", got["kv_text"], unmasked["kv_text"])
    for name in ("kv_ring", "kv_obs"):
        assert_rejects(f"{name}, frames encoded without the instruction", got[name], without_text[name])
    cfg = got_model.cfg
    noise = torch.randn(n, cfg.horizon, cfg.action_dim, generator=torch.Generator().manual_seed(1)).to(got.bufs.device)
    for keep in (None, *SEGMENTS):
        dropped = tuple(SEGMENTS) if keep is None else (keep,)
        with got_mode():
            actions = segment_actions(got, noise, keep)
        with want_mode():
            reference = segment_actions(want, noise, keep)
            wrong = segment_actions(want, noise, keep, dropped)
        what = f"actions over {keep or 'every segment'}"
        assert_agrees(what, actions, reference, base=noise)
        assert_rejects(f"{what}, with {' and '.join(dropped)} dropped", actions, wrong, base=noise)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 300])
def test_fused_kernels_agree_with_the_references(n):
    """The policy step with the Triton kernels (one-token and blocked launch shapes; the expert's
    CUDA kernel at one slot) against the same step with every kernel's torch reference, both
    bf16: to rounding, while the same comparison fails every mutation."""
    model = tiny_model("cuda", sharp=True)
    check_step(model, model, n, contextlib.nullcontext, kernels.reference_only)


def test_the_comparison_passes_rounding_and_rejects_each_mutation():
    """The CPU counterpart, on the same model and inputs: the bf16 references (standing for the
    kernels: rounding apart, the same computation) against the float32 references."""
    check_step(
        tiny_model("cpu", torch.bfloat16, sharp=True),
        tiny_model("cpu", torch.float32, sharp=True),
        1,
        contextlib.nullcontext,
        contextlib.nullcontext,
    )
