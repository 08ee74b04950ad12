"""Weights on disk: ``config.json`` + the tokenizer + ``model.safetensors`` in one folder.

The tokenizer is ``tokenizer.json`` (a word vocabulary) or, for ``tokenizer="paligemma"``
(pi0 / pi0.5, see :mod:`flashrt.policies.convert`), PaliGemma's SentencePiece
``tokenizer.model``. Saving writes each file to a temporary name and renames it into place, so a
crash leaves the old files or the new ones, never a half-written file. Loading reads safetensors
only, checks every tensor name and shape against the config and names each mismatch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes

from flashrt.policies.config import PolicyConfig
from flashrt.policies.model import PRECISIONS, FlowPolicy
from flashrt.policies.tokenizer import PaliGemmaTokenizer, WordTokenizer
from flashrt.runtime.files import atomic_write

CONFIG, TOKENIZER, WEIGHTS = "config.json", "tokenizer.json", "model.safetensors"
SENTENCEPIECE = "tokenizer.model"


class WeightsError(ValueError):
    """A weights folder that does not match its config (or is not a weights folder)."""


def tokenizer_for(source: PolicyConfig | FlowPolicy) -> WordTokenizer | PaliGemmaTokenizer:
    """The tokenizer of a policy: a loaded model's (:func:`load` attaches it), or a word
    tokenizer built from a config's vocabulary. A PaliGemma tokenizer is a file beside the
    weights, so for one pass the model loaded from its folder."""
    if isinstance(source, FlowPolicy):
        tok = getattr(source, "tokenizer", None)
        if tok is not None:
            return tok
        source = source.cfg
    if source.tokenizer == "words":
        return WordTokenizer(source.vocab, source.max_text_len)
    raise WeightsError(
        "this policy reads PaliGemma's SentencePiece tokenizer, a file beside its weights: load the policy "
        "with policies.load(folder) and pass the model to tokenizer_for"
    )


def save(model: FlowPolicy, folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write the model's config, tokenizer and weights (as ``dtype``) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in model.state_dict().items()
    }
    tok = tokenizer_for(model)
    atomic_write(folder / WEIGHTS, lambda f: f.write(save_bytes(tensors, metadata={"format": "flashrt-policy/1"})))
    atomic_write(folder / CONFIG, lambda f: f.write(model.cfg.to_json().encode()))
    if isinstance(tok, PaliGemmaTokenizer):
        atomic_write(folder / SENTENCEPIECE, lambda f: f.write(tok.model_proto))
    else:
        atomic_write(folder / TOKENIZER, lambda f: f.write(tok.to_json().encode()))
    return folder


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(
    folder: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    precision: str = "native",
) -> tuple[FlowPolicy, str]:
    """Build the model in ``folder`` on ``device`` as ``dtype``; returns it and a weights id
    (the SHA-256 of the weights file), which the deployment digest includes. ``precision="fp8"``
    runs its large projections as FP8 GEMMs (:meth:`FlowPolicy.set_precision`; the file is
    unchanged, the e4m3 weights are derived at load)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise WeightsError(f"{folder} has no {CONFIG}; a weights folder holds {CONFIG}, a tokenizer and {WEIGHTS}")
    cfg = PolicyConfig.from_json((folder / CONFIG).read_text())
    tok_file = SENTENCEPIECE if cfg.tokenizer == "paligemma" else TOKENIZER
    for name in (tok_file, WEIGHTS):
        if not (folder / name).is_file():
            raise WeightsError(f"{folder} has no {name}; this weights folder needs {CONFIG}, {tok_file} and {WEIGHTS}")
    if cfg.tokenizer == "paligemma":
        tok = PaliGemmaTokenizer.from_file(folder / tok_file, cfg.max_text_len, state_prompt=cfg.state_token == "text")
        if len(tok) > cfg.vocab_size:
            raise WeightsError(f"{folder / tok_file} has {len(tok)} pieces; the embedding has {cfg.vocab_size} rows")
    else:
        tok = WordTokenizer.from_json((folder / tok_file).read_text())
        if tok.itos != tokenizer_for(cfg).itos or tok.max_len != cfg.max_text_len:
            raise WeightsError(f"{folder / tok_file} does not match the vocabulary in {folder / CONFIG}")
    with torch.device(device):  # initialised where it will run: the init of a pi0-sized model on a CPU takes long
        model = FlowPolicy(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    try:
        got = load_file(folder / WEIGHTS)
    except Exception as e:
        raise WeightsError(f"{folder / WEIGHTS} could not be read (truncated or corrupted?): {e}") from e
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(
        f"{k}: file {tuple(got[k].shape)} vs config {want[k]}"
        for k in set(want) & set(got)
        if tuple(got[k].shape) != want[k]
    )
    if missing or unexpected or wrong:
        raise WeightsError(
            f"{folder / WEIGHTS} does not match {folder / CONFIG}: missing {missing}, unexpected {unexpected}, "
            f"wrong shapes {wrong}"
        )
    model.load_state_dict(got)
    model = model.to(device=device, dtype=dtype)
    if cfg.tokenizer == "paligemma":
        model.tokenizer = tok
    return model.set_precision(precision), file_sha256(folder / WEIGHTS)
