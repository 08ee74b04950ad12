"""Convert a LeRobot pi0 / pi0.5 checkpoint folder into this project's weights folder.

A LeRobot checkpoint (``PI0Policy`` / ``PI05Policy`` ``save_pretrained``, with its processors) is
``config.json``, ``model.safetensors`` and the processors' ``policy_preprocessor.json`` /
``policy_postprocessor.json`` with their normaliser statistics (safetensors). The result is a
folder :func:`flashrt.policies.load` and the env's ``weights=`` read: ``config.json`` (a
:class:`~flashrt.policies.config.PolicyConfig` with pi0's or pi0.5's options), ``model.safetensors``
(the tensors renamed, q/k/v and gate/up fused, the SigLIP patch convolution as a linear layer,
the dataset statistics as buffers), PaliGemma's ``tokenizer.model`` (LeRobot downloads it at run
time; here it is a file the caller gives) and ``source.json`` (the checkpoint's camera, state
and action feature names, in the order the policy reads them).

Only safetensors are read (never pickle). Layer sizes come from the tensors; the head layout
(heads, KV heads, head dim) from the checkpoint's Gemma variants (LeRobot's table), or from
``variants`` for a checkpoint built at other sizes. Anything this model does not compute
(relative actions, empty cameras, other time-embedding periods, tensors it does not know) is
refused with the reason.

    python -m flashrt.policies.convert LEROBOT_FOLDER OUT_FOLDER --tokenizer tokenizer.model
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from flashrt.policies.config import PolicyConfig
from flashrt.policies.model import FlowPolicy
from flashrt.policies.tokenizer import PaliGemmaTokenizer
from flashrt.policies.weights import WeightsError, save
from flashrt.runtime.files import atomic_write

GEMMA = {  # LeRobot's get_gemma_config (openpi's gemma.py): the head layout, which the tensors leave open
    "gemma_2b": {"num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
    "gemma_300m": {"num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
}
SIGLIP = {"num_heads": 16}  # SigLIP So400m/14, PaliGemma's vision tower
NORM_MODES = {"IDENTITY": "identity", "MEAN_STD": "mean_std", "MIN_MAX": "min_max", "QUANTILES": "quantiles",
              "QUANTILE10": "quantile10"}  # fmt: skip
STAT_NAMES = {"mean_std": ("mean", "std"), "min_max": ("min", "max"), "quantiles": ("q01", "q99"),
              "quantile10": ("q10", "q90")}  # fmt: skip
PADDING_STATS = {"mean_std": (0.0, 1.0), "min_max": (-1.0, 1.0), "quantiles": (-1.0, 1.0), "quantile10": (-1.0, 1.0)}
"""Statistics of the zero-padded dims: normalising leaves a 0 a 0 (LeRobot pads after normalising)."""

VLM, EXPERT = "paligemma_with_expert.paligemma.model.", "paligemma_with_expert.gemma_expert.model."
VISION = VLM + "vision_tower.vision_model."
EXPERT_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"  # never run
VLM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"  # never run; tied to the token embedding


class ConversionError(WeightsError):
    """A LeRobot checkpoint this model cannot reproduce exactly, or an incomplete folder."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path} is missing: a LeRobot checkpoint folder has it (save_pretrained writes it)")
    return json.loads(path.read_text())


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ConversionError(f"{path} is missing: LeRobot writes the weights as model.safetensors")
    try:
        sd = load_file(path)
    except Exception as e:
        raise ConversionError(f"{path} could not be read as safetensors: {e}") from e
    return {k.removeprefix("model."): v for k, v in sd.items()}


def _stats(folder: Path, pipeline: str, step: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The (un)normaliser step config and its statistics from ``{pipeline}.json``."""
    spec = _read_json(folder / f"{pipeline}.json")
    steps = [s for s in spec.get("steps", []) if s.get("registry_name") == step]
    if len(steps) != 1:
        raise ConversionError(f"{folder / pipeline}.json has {len(steps)} '{step}' steps; expected one")
    file = steps[0].get("state_file")
    stats = {} if file is None else load_file(folder / file) if (folder / file).is_file() else None
    if stats is None:
        raise ConversionError(f"{folder / file} (the statistics {pipeline}.json names) is missing")
    return steps[0]["config"], stats


def _norm(config: dict, feature: str, kind: str, stats: dict[str, torch.Tensor], dim: int, full: int):
    """(mode, (2, full) float32 statistics or None) for one feature."""
    mode = NORM_MODES[config["norm_map"].get(kind, "IDENTITY")]
    if config.get("eps", 1e-8) != 1e-8:
        raise ConversionError(f"the normaliser's eps is {config['eps']}; this model applies LeRobot's default 1e-8")
    names = STAT_NAMES.get(mode)
    if names is None or not all(f"{feature}.{n}" in stats for n in names):
        return "identity", None  # LeRobot passes a feature without statistics through unchanged
    pad = torch.tensor(PADDING_STATS[mode])[:, None].expand(2, full - dim)
    got = torch.stack([stats[f"{feature}.{n}"].float().reshape(-1) for n in names])
    if got.shape[1] != dim:
        raise ConversionError(f"{feature} statistics have {got.shape[1]} dims; the feature has {dim}")
    return mode, torch.cat([got, pad], dim=1)


def _count(sd: dict, prefix: str) -> int:
    return len({m.group(1) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))})


def _layout(variant: str, variants: dict, q: torch.Tensor, k: torch.Tensor, what: str) -> dict:
    v = {**GEMMA.get(variant, {}), **variants.get(variant, {})}
    if "head_dim" not in v:
        raise ConversionError(f"unknown Gemma variant {variant!r} for the {what}: pass its head layout in variants")
    if q.shape[0] != v["num_heads"] * v["head_dim"] or k.shape[0] != v["num_kv_heads"] * v["head_dim"]:
        raise ConversionError(
            f"the {what}'s q/k projections {tuple(q.shape)} / {tuple(k.shape)} do not fit {variant}'s "
            f"{v['num_heads']} heads, {v['num_kv_heads']} KV heads of {v['head_dim']}"
        )
    return v


def _decoder(sd: dict, src: str, dst: str, depth: int, adaptive: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(depth):
        a, b = f"{src}layers.{i}.", f"{dst}.{i}."
        for ours, theirs in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")):
            if adaptive:
                out[f"{b}{ours}.dense.weight"] = sd.pop(f"{a}{theirs}.dense.weight")
                out[f"{b}{ours}.dense.bias"] = sd.pop(f"{a}{theirs}.dense.bias")
            else:
                out[f"{b}{ours}.weight"] = sd.pop(f"{a}{theirs}.weight")
        out[f"{b}q.weight"] = sd.pop(f"{a}self_attn.q_proj.weight")
        out[f"{b}kv.weight"] = torch.cat([sd.pop(f"{a}self_attn.k_proj.weight"), sd.pop(f"{a}self_attn.v_proj.weight")])
        out[f"{b}o.weight"] = sd.pop(f"{a}self_attn.o_proj.weight")
        out[f"{b}gate_up.weight"] = torch.cat([sd.pop(f"{a}mlp.gate_proj.weight"), sd.pop(f"{a}mlp.up_proj.weight")])
        out[f"{b}down.weight"] = sd.pop(f"{a}mlp.down_proj.weight")
    return out


def convert_lerobot(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike,
    variants: dict | None = None,
) -> Path:
    """Convert the LeRobot pi0 / pi0.5 checkpoint in ``src`` into a weights folder ``dst``.

    Args:
        src: the folder ``save_pretrained`` wrote (policy and processors).
        dst: the weights folder to write (files written atomically).
        tokenizer: PaliGemma's SentencePiece ``tokenizer.model``, copied into ``dst``.
        variants: head layouts by variant name (``{"gemma_2b": {"num_heads", "num_kv_heads",
            "head_dim"}, "siglip": {"num_heads"}}``) overriding LeRobot's table, for checkpoints
            built at other sizes (the tests' tiny fixture).

    Returns:
        ``dst``.
    """
    src, variants = Path(src), variants or {}
    lr = _read_json(src / "config.json")
    tok = PaliGemmaTokenizer.from_file(tokenizer, lr.get("tokenizer_max_length", 0), lr.get("type") == "pi05")
    kind = lr.get("type")
    if kind not in ("pi0", "pi05"):
        raise ConversionError(f"{src / 'config.json'} is a {kind!r} policy; this converter reads pi0 and pi05")
    refuse = {
        "use_relative_actions": (lr.get("use_relative_actions", False), "relative actions"),
        "empty_cameras": (lr.get("empty_cameras", 0), "empty (masked) cameras"),
        "n_obs_steps": (lr.get("n_obs_steps", 1) != 1, "more than one observation step"),
        "periods": ((lr.get("min_period"), lr.get("max_period")) != (4e-3, 4.0), "time periods other than 4e-3..4"),
    }
    for name, (bad, what) in refuse.items():
        if bad:
            raise ConversionError(f"{src / 'config.json'}: {name} asks for {what}, which this model does not compute")
    feats = {**lr["input_features"], **lr["output_features"]}
    cams = [k for k, f in lr["input_features"].items() if f["type"] == "VISUAL"]
    state_dim = int(feats["observation.state"]["shape"][0])
    action_dim = int(feats["action"]["shape"][0])
    for name, dim, full in (("state", state_dim, lr["max_state_dim"]), ("action", action_dim, lr["max_action_dim"])):
        if dim > full:
            raise ConversionError(f"the {name} has {dim} dims, more than max_{name}_dim {full} the model reads")
    res = lr["image_resolution"]
    if res[0] != res[1] or not cams:
        raise ConversionError(f"pi0 reads square images from at least one camera; got {res} and cameras {cams}")

    sd = _tensors(src / "model.safetensors")
    try:
        out, c = _convert_tensors(sd, lr, kind, variants, len(cams))
    except KeyError as e:
        raise ConversionError(f"{src / 'model.safetensors'} lacks {e.args[0]}: not a LeRobot {kind} checkpoint") from e
    pre_cfg, pre_stats = _stats(src, "policy_preprocessor", "normalizer_processor")
    post_cfg, post_stats = _stats(src, "policy_postprocessor", "unnormalizer_processor")
    if pre_cfg["norm_map"].get("VISUAL", "IDENTITY") != "IDENTITY":
        raise ConversionError("the preprocessor normalises images; pi0 reads them as [-1, 1] without statistics")
    state_norm, state_stats = _norm(pre_cfg, "observation.state", "STATE", pre_stats, state_dim, lr["max_state_dim"])
    action_norm, action_stats = _norm(post_cfg, "action", "ACTION", post_stats, action_dim, lr["max_action_dim"])
    if state_stats is not None:
        out["state_stats"] = state_stats
    if action_stats is not None:
        out["action_stats"] = action_stats

    cfg = PolicyConfig(
        vocab=(),
        max_text_len=lr["tokenizer_max_length"],
        num_cameras=len(cams),
        image_size=res[0],
        proprio_dim=lr["max_state_dim"],
        action_dim=lr["max_action_dim"],
        horizon=lr["chunk_size"],
        n_obs_steps=1,
        steps=lr["num_inference_steps"],
        prefix_order="images_first",
        state_token="suffix" if kind == "pi0" else "text",
        norm_plus_one=True,
        time_cond="mlp" if kind == "pi0" else "adarms",
        time_dtype="float32",
        state_norm=state_norm,
        action_norm=action_norm,
        dataset_proprio_dim=state_dim if state_dim < lr["max_state_dim"] else 0,
        dataset_action_dim=action_dim if action_dim < lr["max_action_dim"] else 0,
        tokenizer="paligemma",
        vision_norm_eps=1e-6,
        **c,
    )
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in FlowPolicy(cfg).state_dict().items()}
    wrong = sorted(
        f"{k}: {tuple(out[k].shape)} vs {want[k]}" for k in set(want) & set(out) if tuple(out[k].shape) != want[k]
    )
    if set(want) != set(out) or wrong:
        raise ConversionError(
            f"{src} does not map onto the model: missing {sorted(set(want) - set(out))}, "
            f"unexpected {sorted(set(out) - set(want))}, wrong shapes {wrong}"
        )
    if len(tok) > cfg.vocab_size:
        raise ConversionError(f"{tokenizer} has {len(tok)} pieces; the checkpoint embeds {cfg.vocab_size}")
    with torch.device("meta"):
        model = FlowPolicy(cfg)
    model.load_state_dict(out, assign=True)
    model.tokenizer = tok
    dst = save(model, dst)
    source = {
        "lerobot_type": kind,
        "cameras": cams,
        "state": {"name": "observation.state", "dim": state_dim},
        "action": {"name": "action", "dim": action_dim},
        "source": str(src.resolve()),
        "config": asdict(cfg) | {"vocab": []},
    }
    atomic_write(dst / "source.json", lambda f: f.write((json.dumps(source, indent=1) + "\n").encode()))
    return dst


def _convert_tensors(
    sd: dict[str, torch.Tensor], lr: dict, kind: str, variants: dict, cameras: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """Our state dict from LeRobot's (consumed), and the config fields its shapes fix."""
    sd = dict(sd)
    sd.pop(EXPERT_HEAD, None)
    head = sd.pop(VLM_HEAD, None)  # tied to the embedding: LeRobot's loader fills one from the other
    embed = sd.pop(VLM + "language_model.embed_tokens.weight", head)
    if embed is None:
        raise KeyError(VLM + "language_model.embed_tokens.weight")
    if kind == "pi05":  # LeRobot's loader renames pi0-style time MLPs and drops a state projection
        for k in [k for k in sd if k.startswith(("action_time_mlp_", "state_proj."))]:
            v = sd.pop(k)
            if k.startswith("action_time_mlp_"):
                sd[k.removeprefix("action_")] = v
    depth = _count(sd, VLM + "language_model.layers.")
    if depth != _count(sd, EXPERT + "layers."):
        raise ConversionError("the VLM and the action expert have different depths; pi0 pairs them layer by layer")
    vlm = _layout(lr["paligemma_variant"], variants, sd[VLM + "language_model.layers.0.self_attn.q_proj.weight"],
                  sd[VLM + "language_model.layers.0.self_attn.k_proj.weight"], "VLM")  # fmt: skip
    exp = _layout(lr["action_expert_variant"], variants, sd[EXPERT + "layers.0.self_attn.q_proj.weight"],
                  sd[EXPERT + "layers.0.self_attn.k_proj.weight"], "action expert")  # fmt: skip
    if any(vlm[k] != exp[k] for k in ("num_heads", "num_kv_heads", "head_dim")):
        raise ConversionError("the VLM and the expert must share heads, KV heads and head dim (pi0's joint attention)")
    adaptive = kind == "pi05"
    out = {"text_embed.weight": embed}
    out |= _decoder(sd, VLM + "language_model.", "prefix", depth, adaptive=False)
    out["prefix_norm.weight"] = sd.pop(VLM + "language_model.norm.weight")
    out |= _decoder(sd, EXPERT, "expert", depth, adaptive=adaptive)
    if adaptive:
        out["expert_norm.dense.weight"] = sd.pop(EXPERT + "norm.dense.weight")
        out["expert_norm.dense.bias"] = sd.pop(EXPERT + "norm.dense.bias")
    else:
        out["expert_norm.weight"] = sd.pop(EXPERT + "norm.weight")

    patch = sd.pop(VISION + "embeddings.patch_embedding.weight")  # (W, 3, p, p): our patches are (p, p, 3)
    vw, ps = patch.shape[0], patch.shape[2]
    out["patch_embed.weight"] = patch.permute(0, 2, 3, 1).reshape(vw, -1)
    out["patch_embed.bias"] = sd.pop(VISION + "embeddings.patch_embedding.bias")
    pos = sd.pop(VISION + "embeddings.position_embedding.weight")
    out["vision_pos"] = pos[None].expand(cameras, -1, -1).clone()  # one SigLIP for every camera
    vdepth = _count(sd, VISION + "encoder.layers.")
    for i in range(vdepth):
        a, b = f"{VISION}encoder.layers.{i}.", f"vision.{i}."
        for ours, theirs in (("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("o", "self_attn.out_proj"),
                             ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):  # fmt: skip
            out[f"{b}{ours}.weight"], out[f"{b}{ours}.bias"] = (
                sd.pop(f"{a}{theirs}.weight"),
                sd.pop(f"{a}{theirs}.bias"),
            )
        for p in ("weight", "bias"):
            out[f"{b}qkv.{p}"] = torch.cat([sd.pop(f"{a}self_attn.{x}_proj.{p}") for x in "qkv"])
    out["vision_norm.weight"] = sd.pop(VISION + "post_layernorm.weight")
    out["vision_norm.bias"] = sd.pop(VISION + "post_layernorm.bias")
    out["projector.weight"] = sd.pop(VLM + "multi_modal_projector.linear.weight")
    out["projector.bias"] = sd.pop(VLM + "multi_modal_projector.linear.bias")

    heads = {**SIGLIP, **variants.get("siglip", {})}["num_heads"]
    time = "action_time_mlp" if kind == "pi0" and "time_mlp_in.weight" not in sd else "time_mlp"  # older pi0: time_mlp
    names = {"action_in": "action_in_proj", "action_out": "action_out_proj", "time_in": f"{time}_in",
             "time_out": f"{time}_out"} | ({"state_proj": "state_proj"} if kind == "pi0" else {})  # fmt: skip
    for ours, theirs in names.items():
        out[f"{ours}.weight"], out[f"{ours}.bias"] = sd.pop(f"{theirs}.weight"), sd.pop(f"{theirs}.bias")
    if sd:
        raise ConversionError(f"tensors this model does not compute: {sorted(sd)}")
    fields = {
        "vocab_size": embed.shape[0],
        "patch_size": ps,
        "vision_width": vw,
        "vision_depth": vdepth,
        "vision_heads": heads,
        "vision_mlp": out["vision.0.fc1.weight"].shape[0],
        "width": embed.shape[1],
        "depth": depth,
        "heads": vlm["num_heads"],
        "kv_heads": vlm["num_kv_heads"],
        "head_dim": vlm["head_dim"],
        "mlp": out["prefix.0.down.weight"].shape[1],
        "expert_width": out["expert.0.q.weight"].shape[1],
        "expert_mlp": out["expert.0.down.weight"].shape[1],
    }
    return out, fields


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="LeRobot checkpoint folder (config.json, model.safetensors, processors)")
    ap.add_argument("dst", type=Path, help="weights folder to write")
    ap.add_argument("--tokenizer", type=Path, required=True, help="PaliGemma's SentencePiece tokenizer.model")
    ap.add_argument("--variants", type=Path, help="JSON of head layouts by variant name (non-standard sizes)")
    args = ap.parse_args()
    variants = json.loads(args.variants.read_text()) if args.variants else None
    dst = convert_lerobot(args.src, args.dst, tokenizer=args.tokenizer, variants=variants)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
