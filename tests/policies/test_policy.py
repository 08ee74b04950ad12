import pytest
import torch

from flashrt.policies import FlowPolicy, WeightsError, WordTokenizer, load, save
from flashrt.runtime import restore, snapshot
from tests.policies.small import TEXTS, config, observe, pipeline


def act(p, noise: torch.Tensor) -> torch.Tensor:
    p["noise"].copy_(noise)
    p.denoise()
    return p["actions"].clone()


def test_actions_have_the_configured_shape_and_depend_on_noise():
    p = pipeline(4)
    observe(p, 0)
    z = torch.randn(4, 4, 2)
    a = act(p, z)
    assert a.shape == (4, 4, 2) and torch.isfinite(a).all()
    assert torch.equal(act(p, z), a)
    assert not torch.allclose(act(p, z + 1), a)


def test_restored_state_gives_byte_identical_actions():
    p = pipeline(4)
    observe(p, 1)
    observe(p, 2)
    cap = snapshot(p.bufs)
    z = torch.randn(4, 4, 2)
    want = act(p, z)
    observe(p, 3)  # other observations move the ring and the newest frame
    observe(p, 4)
    assert not torch.equal(act(p, z), want)
    restore(p.bufs, cap)
    assert torch.equal(act(p, z), want)


def test_restoring_the_instruction_without_the_history_ring_diverges():
    p = pipeline(4)
    observe(p, 1)
    observe(p, 2)
    names = [n for n in p.bufs.names("slot") if n not in ("policy.kv_ring", "policy.ring_valid")]
    partial = snapshot(p.bufs, names=names)
    z = torch.randn(4, 4, 2)
    want = act(p, z)
    observe(p, 5)
    restore(p.bufs, partial)
    assert not torch.allclose(act(p, z), want)


def test_slots_are_independent():
    p = pipeline(4)
    observe(p, 1)
    z = torch.randn(4, 4, 2)
    want = act(p, z)
    p["image"][3].random_(0, 255)
    p["proprio"][3].fill_(0.9)
    z[3] += 1
    p.encode_observation()  # slots 0..2 see the same new frame as well: compare on a twin
    twin = pipeline(4)
    observe(twin, 1)
    twin["image"].copy_(p["image"])
    twin["proprio"].copy_(p["proprio"])
    twin["image"][3].zero_()
    twin["proprio"][3].fill_(-0.9)
    twin.encode_observation()
    got, other = act(p, z), act(twin, z * torch.tensor([1, 1, 1, 0])[:, None, None])
    assert torch.equal(got[:3], other[:3]) and not torch.equal(want[:3], got[:3])


def test_draw_noise_is_reproducible_per_slot_and_advances():
    p = pipeline(4)
    p.draw_noise()
    first = p["noise"].clone()
    p.draw_noise()
    assert not torch.equal(first, p["noise"])
    p["rng_counter"].zero_()
    p.draw_noise()
    assert torch.equal(first, p["noise"]) and not torch.equal(first[0], first[1])


def test_training_window_encoding_matches_the_pipeline():
    p = pipeline(2)
    frames = []
    for step in range(2):
        observe(p, 10 + step)
        frames.append((p["image"].clone(), p["proprio"].clone()))
    batch = {
        "text_ids": p["text_ids"].clone(),
        "text_mask": p["text_mask"].clone(),
        "images": torch.stack([f[0] for f in frames], 1),
        "proprio": torch.stack([f[1] for f in frames], 1),
        "frame_valid": torch.ones(2, 2, dtype=torch.bool),
        "frame": torch.ones(2, dtype=torch.int64),
    }
    (text, text_mask), (_, ring_mask), (newest, newest_mask) = p.model.encode_window(batch)
    assert torch.equal(text_mask, p["text_mask"]) and ring_mask.all() and newest_mask.all()
    assert ring_mask.shape == newest_mask.shape == (2, p.cfg.frame_tokens)
    torch.testing.assert_close(text, p["kv_text"])
    torch.testing.assert_close(newest, p["kv_obs"])  # the oldest frame saw more history in the pipeline


def test_flow_matching_loss_trains():
    torch.manual_seed(0)
    model = FlowPolicy(config())
    n = 8
    batch = {
        "text_ids": torch.randint(2, 10, (n, 16)),
        "text_mask": torch.ones(n, 16, dtype=torch.bool),
        "images": torch.randint(0, 256, (n, 2, 1, 32, 32, 3), dtype=torch.uint8),
        "proprio": torch.rand(n, 2, 2),
        "frame_valid": torch.tensor([[False, True]] * 4 + [[True, True]] * 4),
        "frame": torch.tensor([0] * 4 + [5] * 4),
        "actions": torch.rand(n, 4, 2) * 2 - 1,
        "action_mask": torch.ones(n, 4, dtype=torch.bool),
    }
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):  # the same noise and times every step: a fixed objective to fit
        loss = model.loss(batch, torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert torch.isfinite(torch.tensor(losses)).all()
    assert losses[-1] < 0.3 * losses[0]


def test_weights_round_trip_and_mismatches_are_named(tmp_path):
    p = pipeline(2)
    save(p.model, tmp_path / "w")
    model, wid = load(tmp_path / "w")
    assert len(wid) == 64
    for (k, a), (_, b) in zip(p.model.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    other = pipeline(2, cfg=config(mlp=96), seed=1)
    save(other.model, tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "w" / "config.json").read_text())
    with pytest.raises(
        WeightsError, match=r"wrong shapes \['prefix.0.down.weight: file \(64, 96\) vs config \(64, 128\)'"
    ):
        load(tmp_path / "bad")
    (tmp_path / "w" / "tokenizer.json").unlink()
    with pytest.raises(WeightsError, match="has no tokenizer.json"):
        load(tmp_path / "w")
    save(p.model, tmp_path / "c")
    data = (tmp_path / "c" / "model.safetensors").read_bytes()
    (tmp_path / "c" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated or corrupted"):
        load(tmp_path / "c")


def test_rotary_frequencies_stay_float32_when_the_weights_are_converted(tmp_path):
    """Training computes the angles from float32 frequencies; a bf16 deployment must too (rounded
    to bf16 they put a late frame's angles radians off), and the CUDA expert layer reads float32."""
    model = FlowPolicy(config())
    want = model.inv_freq.clone()
    assert want.dtype == torch.float32
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float64)):
        m = convert(FlowPolicy(config()))
        assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, want)
    save(model, tmp_path / "w")
    loaded, _ = load(tmp_path / "w", dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.inv_freq, want)


def test_tokenizer_errors_name_the_problem():
    tok = WordTokenizer(["push", "the", "red"], max_len=3)
    ids, mask = tok.encode("Push the RED")
    assert mask.all() and tok.decode(ids) == ["push the red"]
    with pytest.raises(ValueError, match=r"words \['blue'\] outside the vocabulary"):
        tok.encode("push the blue")
    with pytest.raises(ValueError, match="at most 3"):
        tok.encode("push the red red")
    assert TEXTS[0].split()[0] == "push"


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        config(image_size=30)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        config(heads=3, kv_heads=2)
    from flashrt.policies import PolicyConfig

    with pytest.raises(ValueError, match="unknown fields"):
        PolicyConfig.from_json('{"vocab": [], "bogus": 1}')


def test_folded_weights_refuse_a_refresh_inside_a_capture(monkeypatch):
    """A graph's kernels load weights before waiting for the kernel ahead, so a derived weight
    refreshed inside a capture would race with its readers: the refresh is refused and named;
    unchanged weights are served from the cache as usual."""
    layer = FlowPolicy(config()).expert[0]
    with torch.no_grad():
        layer.qkv_weight()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        layer.qkv_weight()  # weights unchanged: no refresh, no error
        layer.q.weight.add_(1.0)
        with pytest.raises(RuntimeError, match="outside the capture"):
            layer.qkv_weight()


def test_folded_euler_loop_equals_the_unfolded_velocity_integration():
    """sample() runs on weights folded at load time (time embedding into one affine map per
    step, -1/steps into the output projection); it must integrate the same ODE as velocity()."""
    torch.manual_seed(0)
    model = FlowPolicy(config()).eval()
    with torch.no_grad():
        for p in model.parameters():  # weights well away from the init, so every fold matters
            p.add_(0.05 * torch.randn_like(p))
    c, n = model.cfg, 3
    kv = lambda t: torch.randn(n, c.depth, 2, c.kv_heads, t, c.head_dim)  # noqa: E731
    prefix = [  # instruction (a mask per token), ring and newest frame (a flag per frame)
        (kv(c.max_text_len), torch.rand(n, c.max_text_len) < 0.9),
        (kv(c.ring_tokens), (torch.rand(n, 1) < 0.5).expand(-1, c.ring_tokens)),
        (kv(c.frame_tokens), torch.ones(n, c.frame_tokens, dtype=torch.bool)),
    ]
    frame, noise = torch.tensor([0, 3, 7]), torch.randn(n, c.horizon, c.action_dim)
    x = noise.clone()
    for s in range(c.steps):  # with autograd through the weights: the training form of every layer
        t = torch.full((n,), 1.0 - s / c.steps)
        x = (x - model.velocity(x, t, prefix, frame) / c.steps).detach()
    with torch.no_grad():
        folded = model.sample(noise, prefix, frame)
        torch.testing.assert_close(folded, x, atol=1e-5, rtol=1e-5)
        # the folded tensors follow the weights (an in-place load bumps their versions)
        other = FlowPolicy(config())
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(model.sample(noise, prefix, frame), other.eval().sample(noise, prefix, frame))


def test_deployment_digest_names_the_kernel_implementation(monkeypatch):
    from flashrt import kernels
    from flashrt.kernels.backend import triton
    from flashrt.policies import deployment_digest

    assert kernels.implementation("cpu") == "reference"
    assert kernels.implementation("cuda") == ("reference" if triton is None else "triton")
    with kernels.reference_only():
        assert kernels.implementation("cuda") == "reference"
    model = FlowPolicy(config())
    before = deployment_digest(model, "w")
    monkeypatch.setattr(kernels, "implementation", lambda device: "triton")
    assert deployment_digest(model, "w") != before  # outputs of the two agree to rounding only


@pytest.mark.parametrize("adaptive", [False, True])
def test_deferred_down_projections_add_up_to_the_layer_stack(adaptive, monkeypatch):
    """A stack whose down projections each wait for the next layer's first norm (pi0's and
    pi0.5's expert where the projection splits, forced here on the CPU) gives the stack of plain
    layers; the same comparison fails when each pending projection is dropped. A pending without
    the gate an adaptive layer needs, or with one a plain layer cannot use, is refused."""
    import flashrt.policies.layers as pl

    monkeypatch.setattr(pl, "splits", lambda a, w: 2)
    torch.manual_seed(0)
    w, n, t = 48, 2, 5
    layers = [pl.DecoderLayer(w, 2, 1, 32, 96, cond_dim=16 if adaptive else None) for _ in range(3)]
    x = torch.randn(n, t, w)
    pos0, inv_freq = torch.tensor([3, 9]), 1.0 / 10000 ** (torch.arange(16) / 16)
    mods = [1 + 0.3 * torch.randn(2, 3, w) for _ in layers] if adaptive else [None] * 3
    with torch.no_grad():
        want = x.clone()
        for layer, mod in zip(layers, mods, strict=True):
            want, _, _ = layer(want, pos0, inv_freq, mod=mod)
        h, pending, dropped = x.clone(), None, x.clone()
        for layer, mod in zip(layers, mods, strict=True):
            h, pending, _, _ = layer.forward_deferred(h, pending, pos0, inv_freq, mod=mod)
            assert isinstance(pending, pl.Deferred) and (pending.gate is not None) == adaptive
            dropped, _, _, _ = layer.forward_deferred(dropped, None, pos0, inv_freq, mod=mod)
        torch.testing.assert_close(pl.settle(h, pending), want, atol=1e-5, rtol=1e-5)
        with pytest.raises(AssertionError):  # mutation: every pending down projection dropped
            torch.testing.assert_close(dropped, want, atol=1e-5, rtol=1e-5)
        wrong = pl.Deferred(pending.delta, None if adaptive else torch.ones(w))
        with pytest.raises(ValueError, match="needs its gate exactly where the layer is adaptive"):
            layers[0].forward_deferred(h, wrong, pos0, inv_freq, mod=mods[0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_rotation_inside_attention_gives_the_layer_stack(device, adaptive):
    """pi0's and pi0.5's expert layers at head dim 256 with ``rope`` (tables made once; the
    attention rotates queries and keys as it loads the q/k/v projection: the Triton kernel on
    CUDA in bf16, torch ops on the CPU) against the float32 reference stack whose rotary split
    rotates them, over a context segment; no keys come back. The MLPs are zeroed, so what the
    stack changes is its attention. Mutation: the same comparison against tables one position
    later fails (the context keys keep their positions, so the shift shows)."""
    import flashrt.policies.layers as pl
    from flashrt.kernels.grouped_attention import rotates_on_load
    from flashrt.kernels.rotary import rope_tables

    assert rotates_on_load(256)
    torch.manual_seed(0)
    w, n, t, d = 64, 2, 50, 256
    layers = [pl.DecoderLayer(w, 2, 1, d, 96, cond_dim=16 if adaptive else None) for _ in range(2)]
    with torch.no_grad():
        for layer in layers:  # attention sharp enough that a rotation off by one position shows
            layer.q.weight.mul_(2.0)
            layer.kv.weight.mul_(2.0)
            layer.down.weight.zero_()
    x = torch.randn(n, t, w)
    pos0 = torch.tensor([70, 133])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
    mods = [1 + 0.3 * torch.randn(2, 3, w) for _ in layers] if adaptive else [None] * 2
    kv = torch.randn(n, 2, 1, 40, d)
    mask = torch.rand(n, 40) < 0.8

    def stack(on: str, dtype: torch.dtype, rope: bool, shift: int = 0) -> torch.Tensor:
        h, pending, p = x.to(on, dtype, copy=True), None, pos0.to(on)  # the layers write the stream in place
        tables = rope_tables(p + shift, t, inv_freq.to(on), dtype) if rope else None
        context = [(kv[:, 0].to(on, dtype), kv[:, 1].to(on, dtype), mask.to(on))]
        for layer, mod in zip(layers, mods, strict=True):
            layer.to(on, dtype)
            mod = None if mod is None else mod.to(on)
            h, pending, k, _ = layer.forward_deferred(h, pending, p, inv_freq.to(on), context, mod=mod, rope=tables)
            assert (k is None) == rope
        return pl.settle(h, pending).float().cpu()

    with torch.no_grad():
        want = stack("cpu", torch.float32, rope=False)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        tol = 0.03 if dtype == torch.bfloat16 else 1e-5
        off = lambda got: ((got - want).norm() / (want - x).norm()).item()  # noqa: E731 - share of the change
        assert off(stack(device, dtype, rope=True)) < tol
        assert off(stack(device, dtype, rope=True, shift=1)) > tol  # mutation: the rotation one position later
        with pytest.raises(ValueError, match="rope rotates keys inside attention and stores none"):
            layers[0].forward_deferred(x, None, pos0, inv_freq, kv_out=kv, mod=mods[0], rope=(kv, kv))
