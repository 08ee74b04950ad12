"""LeRobot's golden pi0 / pi0.5 fixtures (``fixtures/``, written by ``scripts/make_pi0_fixture.py``)
and the project-side run they are compared with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flashrt.policies import FlowPolicy, load
from flashrt.policies.convert import convert_lerobot

FIXTURES = Path(__file__).parent / "fixtures"
KINDS = ("pi0", "pi05")
TOL = 1e-5
"""fp32 agreement asked of every compared tensor: max |error| <= TOL * max |LeRobot's value|."""


def golden(kind: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The fixture's tensors and metadata (LeRobot/transformers/torch versions, tasks, sizes)."""
    path = FIXTURES / kind / "golden.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    return load_file(path), meta


def convert(kind: str, dst: Path) -> Path:
    """The fixture's LeRobot checkpoint through the converter (its tiny head layouts given)."""
    variants = json.loads((FIXTURES / "variants.json").read_text())
    return convert_lerobot(FIXTURES / kind, dst, tokenizer=FIXTURES / "tokenizer.model", variants=variants)


def load_converted(kind: str, tmp: Path, **kw) -> FlowPolicy:
    model, _ = load(convert(kind, tmp / kind), **kw)
    return model.eval()


def prefix(model: FlowPolicy, g: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor):
    """Block B of the fixture's observation (and block A where the model has one), as segments."""
    n = ids.shape[0]
    frame = torch.zeros(n, dtype=torch.int64, device=ids.device)
    valid = torch.ones(n, dtype=torch.bool, device=ids.device)
    images, state = g["images"].to(ids.device), g["state"].to(ids.device)
    if model.cfg.text_block:
        text = model.encode_text(ids, mask)
        kv, _ = model.encode_frame(images, state, frame, [(text, mask)])
        return [(text, mask), *model.frame_segments(kv, valid)]
    kv, _ = model.encode_frame(images, state, frame, [], text=(ids, mask))
    return model.frame_segments(kv, valid, mask)


def relative_error(got: torch.Tensor, want: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """max |got - want| / max |want| (over ``where``)."""
    err = (got.float().cpu() - want.float()).abs()
    scale = want.float().abs()
    if where is not None:
        err, scale = err * where, scale * where
    return (err.max() / scale.max()).item()
