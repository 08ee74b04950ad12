"""Golden pi0 / pi0.5 fixtures written by LeRobot's own implementation (run rarely; output committed).

LeRobot pins an older torch than this project and needs Python >= 3.12, so it runs in a virtualenv
of its own. Run with any Python:

    python scripts/make_pi0_fixture.py --venv /tmp/lerobot-ref --out tests/policies/fixtures

It builds ``--venv`` (``lerobot[pi]``, ``sentencepiece`` and ``protobuf`` from PyPI; a CUDA build of
torch comes with them, several GB) unless it exists, then re-runs itself inside it (``--inside``),
where it:

1. trains a tiny SentencePiece model with Gemma's settings and special ids (``<pad>`` 0,
   ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3; BPE, byte fallback, split digits, no dummy prefix) and
   loads it as a ``transformers`` ``GemmaTokenizer`` with PaliGemma's ``add_bos_token``: the
   tokenizer LeRobot's processor calls (the real one is a hub download);
2. builds LeRobot's ``PI0Policy`` and ``PI05Policy`` at tiny sizes (its Gemma variant table and
   PaliGemma's hard-wired SigLIP sizes patched to the shapes in ``variants.json``) in float32,
   with every parameter drawn at random (norm scales and adaRMS projections too, so a missing
   ``1 + w`` or conditioning shows), and LeRobot's pre/post-processors with random dataset
   statistics;
3. runs LeRobot's preprocessor (normalisation, prompt, tokenizer), ``sample_actions`` with
   given noise (recording the prefix keys/values its prefill returns) and the postprocessor;
4. writes, per policy, a LeRobot checkpoint folder (``save_pretrained`` of the policy and both
   processors: what the converter reads) and ``golden.safetensors``: raw inputs (uint8 images,
   state, task strings in the metadata), token ids and mask, the noise, the denoised actions
   (padded and normalised, and through the postprocessor), the prefix keys/values of the last
   layer and the prefix's validity mask.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

LEROBOT = "lerobot[pi]==0.6.1"  # the release this fixture was generated with (see the golden metadata)
TASKS = ["pick up the red cup and put it in the bowl", "open the drawer"]
BATCH, CAMERAS, IMAGE, STATE_DIM, ACTION_DIM = 2, 3, 56, 6, 5
VARIANTS = {  # tiny stand-ins for gemma_2b (the VLM), gemma_300m (the expert) and SigLIP So400m
    "gemma_2b": {"width": 64, "depth": 2, "mlp_dim": 96, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32},
    "gemma_300m": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32},
    "siglip": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 2, "patch_size": 14},
    "vocab_size": 400,
}


def build_venv(venv: Path, python: str) -> Path:
    exe = venv / "bin" / "python"
    if not exe.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(exe), "-m", "pip", "install", "-q", LEROBOT, "sentencepiece", "protobuf"], check=True)
    return exe


def train_tokenizer(folder: Path):
    """A 400-piece SentencePiece model with Gemma's settings, and transformers' GemmaTokenizer of it."""
    import io

    import sentencepiece as spm
    from transformers import GemmaTokenizer

    corpus = [
        *TASKS,
        "push the red square to the left goal",
        "stack the green block on the yellow block",
        "Task: open the drawer, State: 12 200 34 0 255 7;\nAction: ",
        "move the arm to the right and close the gripper",
    ] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, vocab_size=VARIANTS["vocab_size"], model_type="bpe",
        byte_fallback=True, split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True, character_coverage=1.0,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=["\n"], minloglevel=2,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    return GemmaTokenizer.from_pretrained(folder, add_bos_token=True, add_eos_token=False)


def patch_lerobot(tokenizer) -> None:
    """Shrink LeRobot's hard-wired sizes to VARIANTS and hand its processors the tiny tokenizer."""
    import functools

    from lerobot.policies.pi0 import modeling_pi0, processor_pi0
    from lerobot.policies.pi05 import modeling_pi05, processor_pi05

    def gemma(variant: str):
        v = VARIANTS[variant]
        return modeling_pi0.GemmaConfig(
            v["width"], v["depth"], v["mlp_dim"], v["num_heads"], v["num_kv_heads"], v["head_dim"]
        )

    for mod in (modeling_pi0, modeling_pi05):
        paligemma_cls, expert_cls = mod.PaliGemmaForConditionalGenerationWithPiGemma, mod.PiGemmaForCausalLM

        def paligemma(config, cls=paligemma_cls):
            s = VARIANTS["siglip"]
            vc = config.vision_config
            vc.hidden_size, vc.num_hidden_layers, vc.intermediate_size = s["width"], s["depth"], s["mlp_dim"]
            vc.num_attention_heads, vc.patch_size = s["num_heads"], s["patch_size"]
            vc.projection_dim = config.text_config.hidden_size
            config.projection_dim = config.text_config.hidden_size
            config.text_config.vocab_size = VARIANTS["vocab_size"]
            return cls(config=config)

        def expert(config, cls=expert_cls):
            config.vocab_size = 8  # the expert's (unused) lm_head
            return cls(config=config)

        mod.get_gemma_config = gemma
        mod.PaliGemmaForConditionalGenerationWithPiGemma = paligemma
        mod.PiGemmaForCausalLM = expert
    for mod in (processor_pi0, processor_pi05):
        mod.TokenizerProcessorStep = functools.partial(mod.TokenizerProcessorStep, tokenizer=tokenizer)


def randomize(policy, gen) -> None:
    """Every parameter at random, scaled so activations stay O(1) and attention is not uniform."""
    import torch

    for name, p in policy.named_parameters():
        with torch.no_grad():
            if "norm" in name and "dense" not in name:  # Gemma's w in (1 + w) and LayerNorm scales
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "layer_norm" in name else 0.0))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "dense" in name:  # adaRMS scale/shift/gate projections
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[1] ** 0.5)
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / fan_in**0.5)


def stats(gen, dim: int) -> dict:
    import torch

    lo = torch.randn(dim, generator=gen) - 1.0
    hi = lo + torch.rand(dim, generator=gen) * 2 + 0.5
    mean, std = (lo + hi) / 2, torch.rand(dim, generator=gen) + 0.3
    return {"mean": mean, "std": std, "min": lo - 0.2, "max": hi + 0.2, "q01": lo, "q99": hi}


def make(kind: str, out: Path, tokenizer, seed: int) -> None:
    import lerobot
    import torch
    import transformers
    from lerobot.configs import FeatureType, PolicyFeature
    from safetensors.torch import save_file

    if kind == "pi0":
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
        from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors as processors
    else:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
        from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors as processors

    gen = torch.Generator().manual_seed(seed)
    cams = [f"observation.images.cam{i}" for i in range(CAMERAS)]
    config = Config(
        device="cpu",
        dtype="float32",
        image_resolution=(IMAGE, IMAGE),
        tokenizer_max_length=48 if kind == "pi0" else 96,
        input_features={
            **{c: PolicyFeature(type=FeatureType.VISUAL, shape=(3, IMAGE, IMAGE)) for c in cams},
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
    )
    torch.manual_seed(seed)
    policy = Policy(config).eval()
    randomize(policy, gen)
    dataset_stats = {"observation.state": stats(gen, STATE_DIM), "action": stats(gen, ACTION_DIM)}
    pre, post = processors(config, dataset_stats)

    images = torch.randint(0, 256, (BATCH, CAMERAS, IMAGE, IMAGE, 3), generator=gen, dtype=torch.uint8)
    state = dataset_stats["observation.state"]["mean"] + torch.randn(BATCH, STATE_DIM, generator=gen)
    batch = {c: images[:, i].permute(0, 3, 1, 2).float() / 255.0 for i, c in enumerate(cams)}
    batch |= {"observation.state": state, "task": list(TASKS)}
    noise = torch.randn(BATCH, config.chunk_size, config.max_action_dim, generator=gen)

    model = policy.model
    prefill = {}
    forward = model.paligemma_with_expert.forward

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs["inputs_embeds"][1] is None:  # the prefix prefill: keep its cache and mask
            prefill["cache"] = out[1]
        return out

    model.paligemma_with_expert.forward = recording_forward
    embed_prefix = model.embed_prefix

    def recording_embed_prefix(*args, **kwargs):
        embs, pad, att = embed_prefix(*args, **kwargs)
        prefill["pad"] = pad
        return embs, pad, att

    model.embed_prefix = recording_embed_prefix
    with torch.no_grad():
        processed = pre(batch)
        chunk = policy.predict_action_chunk(processed, noise=noise.clone())  # (B, H, ACTION_DIM), normalised
        actions = post(chunk)
        imgs, img_masks = policy._preprocess_images(processed)
        args = [
            imgs,
            img_masks,
            processed["observation.language.tokens"],
            processed["observation.language.attention_mask"],
        ]
        if kind == "pi0":
            args.append(policy.prepare_state(processed))
        full = model.sample_actions(*args, noise=noise.clone())  # (B, H, 32), normalised, padded
    assert torch.equal(full[:, :, :ACTION_DIM], chunk), "sample_actions and predict_action_chunk disagree"
    last = prefill["cache"].layers[-1]

    folder = out / kind
    folder.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(folder)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)  # a model card: not needed
    golden = {
        "images": images,
        "state": state,
        "noise": noise,
        "text_ids": processed["observation.language.tokens"],
        "text_mask": processed["observation.language.attention_mask"].bool(),
        "state_normalized": processed["observation.state"],
        "actions_normalized": full,
        "actions": actions,
        "prefix_mask": prefill["pad"],
        "prefix_keys_last_layer": last.keys,
        "prefix_values_last_layer": last.values,
    }
    meta = {
        "lerobot": lerobot.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "policy": kind,
        "tasks": json.dumps(TASKS),
        "variants": json.dumps(VARIANTS),
    }
    save_file({k: v.contiguous() for k, v in golden.items()}, str(folder / "golden.safetensors"), metadata=meta)
    print(kind, {k: tuple(v.shape) for k, v in golden.items()})


def inside(out: Path) -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    tokenizer = train_tokenizer(out)
    (out / "variants.json").write_text(json.dumps(VARIANTS, indent=1) + "\n")
    patch_lerobot(tokenizer)
    for seed, kind in enumerate(("pi0", "pi05")):
        make(kind, out, tokenizer, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("tests/policies/fixtures"))
    ap.add_argument("--venv", type=Path, default=Path("/tmp/lerobot-ref"))
    ap.add_argument("--python", default="python3.12", help="a Python >= 3.12 to build the venv with")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        inside(args.out.resolve())
        return
    exe = build_venv(args.venv, args.python)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the fixture is float32 on the CPU
    cmd = [str(exe), __file__, "--inside", "--out", str(args.out.resolve())]
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
