"""pi0 / pi0.5 with ``precision="fp8"``: the stated tolerance (docs/FP8.md), tested.

On any machine the FP8 numerics run emulated (:func:`flashrt.kernels.fp8.linear_emulated`: the
same e4m3 weights and per-token activations, multiplied in float32) against LeRobot's float32
golden fixtures; on an FP8 GPU (``cuda`` marker, compute capability >= 8.9) the real
``torch._scaled_mm`` path, under graph replay, against the fixtures and against the bf16 path at
pi0's full size. Every bound has its mutation beside it: one output channel's weight scale
doubled must break it.

The measure is the worst channel's relative error, ``max_c ||got_c - want_c|| / ||want_c||`` over
the last dimension (a key/value head dim, an action dim): FP8's rounding spreads evenly over
channels, while one wrong channel, which a norm over everything would dilute by its share, is
caught whole.
"""

import pytest
import torch

from flashrt.kernels import fp8
from flashrt.policies import FlowPolicy, deployment_digest, load
from tests.policies.golden import KINDS, convert, golden, load_converted, prefix

BOUNDS = {"keys": 0.35, "values": 0.35, "actions": 0.2}
"""Fixture bounds (vs LeRobot's float32), worst channel: measured 0.20-0.24 (keys, values of the
last layer) and 0.04-0.12 (actions) on the emulated path (docs/FP8.md)."""


def channel_error(got: torch.Tensor, want: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """``max_c ||got[..., c] - want[..., c]|| / ||want[..., c]||`` (over ``where``, broadcast)."""
    got, want = got.float().cpu(), want.float().cpu()
    if where is not None:
        got, want = got * where, want * where
    err = (got - want).flatten(0, -2).norm(dim=0)
    return (err / want.flatten(0, -2).norm(dim=0).clamp_min(1e-30)).max().item()


def fixture_errors(model: FlowPolicy, kind: str) -> dict[str, float]:
    """Worst-channel errors of the last layer's prefix keys/values (the valid tokens) and of the
    normalised actions against LeRobot's."""
    g, _ = golden(kind)
    device = next(model.parameters()).device
    ids, mask = g["text_ids"].to(device), g["text_mask"].to(device)
    frame = torch.zeros(len(ids), dtype=torch.int64, device=device)
    with torch.no_grad():
        segments = prefix(model, g, ids, mask)
        kv, _ = model.encode_frame(g["images"].to(device), g["state"].to(device), frame, [], text=(ids, mask))
        actions = model.sample(g["noise"].to(device), segments, frame)
    n, valid = g["prefix_mask"].shape[1], g["prefix_mask"][:, None, :, None]
    return {
        "keys": channel_error(kv[:, -1, 0, :, :n], g["prefix_keys_last_layer"], valid),
        "values": channel_error(kv[:, -1, 1, :, :n], g["prefix_values_last_layer"], valid),
        "actions": channel_error(model.normalize_actions(actions), g["actions_normalized"]),
    }


def within(errors: dict[str, float], bounds: dict[str, float]) -> bool:
    return all(errors[k] <= bounds[k] for k in bounds)


def double_key_scale(model: FlowPolicy) -> None:
    """The mutation: the e4m3 scale of one output channel (the last prefix layer's first key
    channel) doubled in place."""
    layer = model.prefix[-1]
    layer.fp8.get()["qkv"].scale[layer.heads * layer.head_dim] *= 2


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, FlowPolicy]:
    tmp = tmp_path_factory.mktemp("converted")
    return {kind: load_converted(kind, tmp) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_emulated_fp8_is_within_the_bounds_of_lerobot_and_a_doubled_scale_is_not(converted, kind):
    model = converted[kind].set_precision("fp8")
    try:
        errors = fixture_errors(model, kind)
        assert within(errors, BOUNDS), errors
        assert min(errors.values()) > 1e-3  # FP8 did run: the float32 path is within 1e-5
        double_key_scale(model)
        wrong = fixture_errors(model, kind)
        assert not within(wrong, BOUNDS) and wrong["keys"] > 1.5 * BOUNDS["keys"], wrong
    finally:
        model.set_precision("native")


def test_precision_switches_back_to_the_exact_path(converted):
    model = converted["pi0"]
    exact = fixture_errors(model, "pi0")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    native = deployment_digest(model, "w")
    model.set_precision("fp8")
    assert model.precision == "fp8" and deployment_digest(model, "w") != native
    fixture_errors(model, "pi0")
    model.set_precision("native")
    assert model.precision == "native" and deployment_digest(model, "w") == native
    assert fixture_errors(model, "pi0") == exact and max(exact.values()) < 1e-4
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())  # the parameters never changed


def test_fp8_weights_follow_the_parameters(converted):
    """The e4m3 copies are derived: change a weight and they are requantised in place."""
    model = converted["pi0"].set_precision("fp8")
    try:
        layer = model.expert[0]
        before = layer.fp8.get()["down"]
        scale = before.scale.clone()
        with torch.no_grad():
            layer.down.weight.mul_(2)
        after = layer.fp8.get()["down"]
        assert after.scale.data_ptr() == before.scale.data_ptr()  # rewritten where a graph reads it
        torch.testing.assert_close(after.scale, 2 * scale)
        with torch.no_grad():
            layer.down.weight.div_(2)
    finally:
        model.set_precision("native")


def test_load_takes_the_precision(tmp_path):
    folder = convert("pi0", tmp_path / "pi0")
    model, _ = load(folder, precision="fp8")
    assert model.precision == "fp8" and all(b.fp8 is not None for b in (*model.vision, *model.prefix, *model.expert))
    with pytest.raises(ValueError, match="precision must be one of"):
        load(folder, precision="int4")
    with pytest.raises(ValueError, match="precision must be one of"):
        model.set_precision("fp16")


# -- on an FP8 GPU: torch._scaled_mm under graph replay -------------------------------------------

needs_fp8 = pytest.mark.skipif(
    not fp8.supported("cuda" if torch.cuda.is_available() else "cpu"),
    reason="needs an FP8 GPU (compute capability >= 8.9)",
)

FULL_BOUNDS = {"keys": 0.5, "values": 0.5, "actions": 0.35}
"""pi0 at full size (random weights, 18 + 27 layers), FP8 vs the bf16 path, worst channel over
every layer's prefix keys/values and the actions (docs/FP8.md)."""


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_graph_replay_is_within_the_bounds_of_lerobot(tmp_path, kind):
    from flashrt.runtime import Graph
    from tests.policies.test_lerobot_cuda import fed, step

    g, meta = golden(kind)
    model = load_converted(kind, tmp_path, device="cuda", dtype=torch.bfloat16).set_precision("fp8")
    assert fp8.runs_scaled_mm(torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    eager, graphed = fed(model, g, meta), fed(model, g, meta)
    step(eager)
    graph = Graph(f"{kind}-fp8").bind(graphed.bufs)
    graph.capture(2, lambda: step(graphed))
    graph.replay(2)
    torch.cuda.synchronize()
    assert torch.equal(eager.bufs.slot_arena, graphed.bufs.slot_arena)
    errors = fixture_errors(model, kind)
    print(f"{kind} fp8 (scaled_mm) vs LeRobot, worst channel: {errors}")
    assert within(errors, BOUNDS), errors
    want = g["actions_normalized"]
    got = model.normalize_actions(graphed["actions"]).cpu()
    assert channel_error(got, want) <= BOUNDS["actions"]
    double_key_scale(model)
    assert not within(fixture_errors(model, kind), BOUNDS)


def full_size_run(model: FlowPolicy, n: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pi0's block B keys/values (N, S, 2, g, T_B, d), its token mask and the actions for fixed
    random inputs (3 cameras of 224x224, 48 tokens of which 20 live)."""
    c, gen = model.cfg, torch.Generator(device="cuda").manual_seed(1)
    images = torch.randint(0, 256, (n, c.num_cameras, c.image_size, c.image_size, 3), device="cuda",
                           dtype=torch.uint8, generator=gen)  # fmt: skip
    state = torch.randn(n, c.proprio_dim, device="cuda", generator=gen)
    ids = torch.randint(1, c.vocab_size, (n, c.max_text_len), device="cuda", generator=gen)
    mask = torch.arange(c.max_text_len, device="cuda")[None].expand(n, -1) < 20
    noise = torch.randn(n, c.horizon, c.action_dim, device="cuda", generator=gen)
    frame, valid = torch.zeros(n, dtype=torch.int64, device="cuda"), torch.ones(n, dtype=torch.bool, device="cuda")
    with torch.no_grad():
        kv, _ = model.encode_frame(images, state, frame, [], text=(ids, mask))
        actions = model.sample(noise, model.frame_segments(kv, valid, mask), frame)
    ones = torch.ones(n, c.image_tokens, dtype=torch.bool, device="cuda")
    live = torch.cat([ones, mask, ones[:, :1]], 1)
    return kv, live, actions


def full_size_errors(kv, actions, want_kv, want_actions, live) -> dict[str, float]:
    """Worst channel over every layer (each layer's keys and values apart) and the actions."""
    where = live[:, None, :, None].cpu()
    layers = range(kv.shape[1])
    return {
        "keys": max(channel_error(kv[:, i, 0], want_kv[:, i, 0], where) for i in layers),
        "values": max(channel_error(kv[:, i, 1], want_kv[:, i, 1], where) for i in layers),
        "actions": channel_error(actions, want_actions),
    }


@pytest.mark.cuda
@needs_fp8
def test_pi0_full_size_fp8_is_within_the_bounds_of_bf16():
    import dataclasses

    from flashrt.policies.config import lerobot_pi0

    torch.manual_seed(0)
    with torch.device("cuda"):  # pi0's shapes and computation; a small vocabulary (the table is only looked up)
        model = FlowPolicy(dataclasses.replace(lerobot_pi0(), vocab_size=512)).to(torch.bfloat16).eval()
    want_kv, live, want_actions = full_size_run(model)
    model.set_precision("fp8")
    kv, _, actions = full_size_run(model)
    errors = full_size_errors(kv, actions, want_kv, want_actions, live)
    print(f"pi0 full size, fp8 vs bf16, worst channel: {errors}")
    assert within(errors, FULL_BOUNDS), errors
    assert min(errors.values()) > 1e-3
    double_key_scale(model)
    kv, _, actions = full_size_run(model)
    wrong = full_size_errors(kv, actions, want_kv, want_actions, live)
    assert not within(wrong, FULL_BOUNDS), wrong
