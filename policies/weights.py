"""Weights on disk: ``config.json`` + ``tokenizer.json`` + ``model.safetensors`` in one folder.

Saving writes each file to a temporary name and renames it into place, so a crash leaves the
old files or the new ones, never a half-written file. Loading checks every tensor name and
shape against the config and names each mismatch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes

from flashrt.policies.config import PolicyConfig
from flashrt.policies.model import FlowPolicy
from flashrt.policies.tokenizer import WordTokenizer
from flashrt.runtime.files import atomic_write

CONFIG, TOKENIZER, WEIGHTS = "config.json", "tokenizer.json", "model.safetensors"


class WeightsError(ValueError):
    """A weights folder that does not match its config (or is not a weights folder)."""


def tokenizer_for(cfg: PolicyConfig) -> WordTokenizer:
    return WordTokenizer(cfg.vocab, cfg.max_text_len)


def save(model: FlowPolicy, folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write the model's config, tokenizer and weights (as ``dtype``) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in model.state_dict().items()
    }
    atomic_write(folder / WEIGHTS, lambda f: f.write(save_bytes(tensors, metadata={"format": "flashrt-policy/1"})))
    atomic_write(folder / CONFIG, lambda f: f.write(model.cfg.to_json().encode()))
    atomic_write(folder / TOKENIZER, lambda f: f.write(tokenizer_for(model.cfg).to_json().encode()))
    return folder


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(
    folder: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[FlowPolicy, str]:
    """Build the model in ``folder`` on ``device`` as ``dtype``; returns it and a weights id
    (the SHA-256 of the weights file), which the deployment digest includes."""
    folder = Path(folder)
    for name in (CONFIG, TOKENIZER, WEIGHTS):
        if not (folder / name).is_file():
            raise WeightsError(f"{folder} has no {name}; a weights folder holds {CONFIG}, {TOKENIZER} and {WEIGHTS}")
    cfg = PolicyConfig.from_json((folder / CONFIG).read_text())
    tok = WordTokenizer.from_json((folder / TOKENIZER).read_text())
    if tok.itos != tokenizer_for(cfg).itos or tok.max_len != cfg.max_text_len:
        raise WeightsError(f"{folder / TOKENIZER} does not match the vocabulary in {folder / CONFIG}")
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
    return model.to(device=device, dtype=dtype), file_sha256(folder / WEIGHTS)
