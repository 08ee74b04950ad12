"""pi0 / pi0.5 against LeRobot's own implementation (golden fixtures from LeRobot 0.6.1).

The fixture is a tiny random-weight LeRobot checkpoint with the inputs LeRobot was given and
what it computed. It goes through the converter and the loader; the tokenizer, the dataset
normalisation, the prefix keys/values and the denoised actions must agree in float32 to 1e-5 of
their scale. Beside each equivalence, mutation checks: the same comparison with one pi0 option
deliberately wrong must fail by far more than the tolerance.
"""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from flashrt.policies import FlowPolicy, WeightsError, load, save, tokenizer_for
from flashrt.policies import model as model_module
from flashrt.policies.convert import ConversionError, convert_lerobot
from flashrt.policies.layers import AdaRMSNorm, euler_times
from tests.policies.golden import FIXTURES, KINDS, TOL, golden, load_converted, prefix, relative_error


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, FlowPolicy]:
    tmp = tmp_path_factory.mktemp("converted")
    return {kind: load_converted(kind, tmp) for kind in KINDS}


def ids_of(model: FlowPolicy, g, meta):
    """The fixture's tasks (and normalised states, pi0.5) through the project's tokenizer."""
    states = model.normalize_state(g["state"])[:, : g["state"].shape[1]] if model.cfg.state_token == "text" else None
    return tokenizer_for(model).encode(json.loads(meta["tasks"]), states)


def actions_error(model: FlowPolicy, g, ids, mask) -> float:
    with torch.no_grad():
        actions = model.sample(g["noise"], prefix(model, g, ids, mask), torch.zeros(len(ids), dtype=torch.int64))
    return relative_error(model.normalize_actions(actions), g["actions_normalized"])


@pytest.mark.parametrize("kind", KINDS)
def test_converted_checkpoint_reproduces_lerobot(converted, kind):
    model, (g, meta) = converted[kind], golden(kind)
    assert meta["lerobot"] == "0.6.1" and meta["policy"] == kind
    ids, mask = ids_of(model, g, meta)
    assert torch.equal(ids, g["text_ids"]) and torch.equal(mask, g["text_mask"])
    d = g["state"].shape[1]
    assert relative_error(model.normalize_state(g["state"])[:, :d], g["state_normalized"]) <= TOL
    assert not model.normalize_state(g["state"])[:, d:].any()  # pi0 pads the normalised state with zeros
    frame, valid = torch.zeros(len(ids), dtype=torch.int64), torch.ones(len(ids), dtype=torch.bool)
    with torch.no_grad():
        block, _ = model.encode_frame(g["images"], g["state"], frame, [], text=(ids, mask))
        segments = model.frame_segments(block, valid, mask)
        kv = block[:, -1]  # the last layer, (N, 2, g, T_B, d): image tokens, language, state
        n_prefix = g["prefix_mask"].shape[1]
        valid = g["prefix_mask"][:, None, :, None]
        assert relative_error(kv[:, 0, :, :n_prefix], g["prefix_keys_last_layer"], valid) <= TOL
        assert relative_error(kv[:, 1, :, :n_prefix], g["prefix_values_last_layer"], valid) <= TOL
        actions = model.sample(g["noise"], segments, frame)
    assert relative_error(model.normalize_actions(actions), g["actions_normalized"]) <= TOL
    a = g["actions"].shape[2]
    assert relative_error(actions[:, :, :a], g["actions"]) <= TOL  # through LeRobot's postprocessor


@pytest.mark.parametrize("kind", KINDS)
def test_training_form_integrates_to_the_same_actions(converted, kind):
    """velocity() (unfolded, what training differentiates) at LeRobot's Euler times, stepped by
    hand, lands on LeRobot's actions too: the folded sampler and the training form agree."""
    model, (g, _) = converted[kind], golden(kind)
    frame = torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        segments = prefix(model, g, g["text_ids"], g["text_mask"])
        x = g["noise"].clone()
        for t in euler_times(model.cfg.steps, model.cfg.time_dtype):
            x = x - model.velocity(x, t.float().expand(2), segments, frame) / model.cfg.steps
    assert relative_error(x, g["actions_normalized"]) <= TOL


def mutated(model: FlowPolicy, **options) -> FlowPolicy:
    """The converted model with config options changed and its weights carried over (a state
    projection moved to the prefix's width for ``state_token="prefix"``)."""
    other = FlowPolicy(dataclasses.replace(model.cfg, **options)).eval()
    sd = model.state_dict()
    if options.get("state_token") == "prefix":
        w, b = sd.pop("state_proj.weight"), sd.pop("state_proj.bias")
        sd["proprio_proj.weight"] = F.pad(w, (0, 0, 0, other.cfg.width - w.shape[0]))
        sd["proprio_proj.bias"] = F.pad(b, (0, other.cfg.width - b.shape[0]))
    other.load_state_dict(sd)
    return other


MUTATIONS = {
    "state token in the prefix": ("pi0", {"state_token": "prefix"}),
    "language first (pi0)": ("pi0", {"prefix_order": "text_first"}),
    "language first (pi0.5)": ("pi05", {"prefix_order": "text_first"}),
    "norm scale w, not 1 + w (pi0)": ("pi0", {"norm_plus_one": False}),
    "norm scale w, not 1 + w (pi0.5)": ("pi05", {"norm_plus_one": False}),
    "sin and cos swapped in the time embedding (pi0)": ("pi0", "sincos"),
    "sin and cos swapped in the time embedding (pi0.5)": ("pi05", "sincos"),
    "adaRMS scale without the 1 +": ("pi05", "adarms"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_wrong_option_fails_the_comparison(converted, monkeypatch, name):
    kind, change = MUTATIONS[name]
    model, (g, _) = converted[kind], golden(kind)
    if change == "sincos":
        sincos = model_module.sincos
        monkeypatch.setattr(model_module, "sincos", lambda t, d, *a: sincos(t, d, *a).roll(d // 2, -1))
    elif change == "adarms":
        modulation = AdaRMSNorm.modulation
        monkeypatch.setattr(
            AdaRMSNorm, "modulation", lambda self, c: modulation(self, c) - F.pad(torch.ones(1, 1), (0, 0, 0, 2))
        )
    wrong = mutated(model, **change) if isinstance(change, dict) else mutated(model)
    assert actions_error(wrong, g, g["text_ids"], g["text_mask"]) > 100 * TOL


def test_float64_euler_times_are_measurably_further_from_lerobot(converted):
    """LeRobot holds the Euler times as float32: time_dtype="float32" is the closer match."""
    model, (g, _) = converted["pi0"], golden("pi0")
    exact = actions_error(model, g, g["text_ids"], g["text_mask"])
    assert actions_error(mutated(model, time_dtype="float64"), g, g["text_ids"], g["text_mask"]) > 2 * exact


def test_converted_weights_round_trip_and_name_their_tokenizer(converted, tmp_path):
    model = converted["pi0"]
    save(model, tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.model").read_bytes() == (FIXTURES / "tokenizer.model").read_bytes()
    again, _ = load(tmp_path / "again")
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(WeightsError, match="pass the model to tokenizer_for"):
        tokenizer_for(model.cfg)
    (tmp_path / "again" / "tokenizer.model").unlink()
    with pytest.raises(WeightsError, match="has no tokenizer.model"):
        load(tmp_path / "again")


def test_paligemma_prompts_truncate_and_pad_as_lerobot(converted):
    tok = tokenizer_for(converted["pi05"])
    with pytest.raises(ValueError, match="pass states"):
        tok.encode("open the drawer")
    ids, mask = tok.encode(["open_the drawer\n"], torch.tensor([[-1.5, -1.0, 0.0, 0.999, 1.0, 2.0]]))
    assert tok.decode(ids) == ["Task: open the drawer, State: -1 0 128 255 255 255;\nAction: "]
    assert ids[0, 0] == tok.bos and mask.sum() < tok.max_len and not ids[0, mask.sum() :].any()
    short = type(tok)(tok.model_proto, max_len=5, state_prompt=False)  # pi0's prompt: the task and a newline
    ids, mask = short.encode(["pick up the red cup and put it in the bowl", "open"])
    assert ids.shape == (2, 5) and mask[0].all() and mask[1].tolist() == [True] * 3 + [False] * 2
    assert "pick up the red cup and put it in the bowl\n".startswith(short.decode(ids)[0])
    assert short.decode(ids)[1] == "open\n"


def test_converter_refuses_what_it_cannot_reproduce(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "pi0", src)
    with pytest.raises(FileNotFoundError, match="no SentencePiece tokenizer at .*missing.model"):
        convert_lerobot(src, tmp_path / "a", tokenizer=tmp_path / "missing.model",
                        variants=json.loads((FIXTURES / "variants.json").read_text()))  # fmt: skip
    with pytest.raises(ConversionError, match="unknown Gemma variant|do not fit gemma_2b"):
        convert_lerobot(src, tmp_path / "b", tokenizer=FIXTURES / "tokenizer.model")  # LeRobot's real head layout
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"use_relative_actions": True}))
    with pytest.raises(ConversionError, match="relative actions"):
        convert_lerobot(src, tmp_path / "c", tokenizer=FIXTURES / "tokenizer.model")
    (src / "config.json").write_text(json.dumps(config))
    (src / "policy_postprocessor.json").unlink()
    with pytest.raises(ConversionError, match="policy_postprocessor.json is missing"):
        convert_lerobot(src, tmp_path / "d", tokenizer=FIXTURES / "tokenizer.model",
                        variants=json.loads((FIXTURES / "variants.json").read_text()))  # fmt: skip
    assert not any((tmp_path / x).exists() for x in "abcd")  # nothing half-written
