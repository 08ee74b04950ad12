"""Converted pi0 / pi0.5 in bf16 under CUDA graph replay, against LeRobot's float32 golden actions
(run on the GPU machine: pytest -m cuda).

The observation encode and the denoising run over static buffers (the way the pipeline holds a
slot's state), are captured once as a graph and replayed: replay must equal the eager bf16 run
byte for byte, and both must land within bf16 rounding of LeRobot's float32 result; with
Gemma's ``1 + w`` norm scale (pi0) or adaRMS's ``1 + scale`` (pi0.5) switched off the same
comparison must fail.
"""

import dataclasses

import pytest
import torch

from flashrt.policies import FlowPolicy
from flashrt.policies.model import AdaRMSNorm
from flashrt.runtime import BufferSet, Graph, slot
from tests.policies.golden import KINDS, golden, load_converted

pytestmark = pytest.mark.cuda

BF16_TOL = 0.03
"""||bf16 - fp32|| / ||fp32|| allowed: bf16 keeps 8 bits of mantissa (2^-9 = 0.002 per rounding),
and the error of a few layers and ten Euler steps compounds to ~1e-2; a wrong option is O(0.1-1)."""


def buffers(model: FlowPolicy, n: int) -> BufferSet:
    c = model.cfg
    return BufferSet(
        [
            slot("image", (c.num_cameras, c.image_size, c.image_size, 3), torch.uint8),
            slot("proprio", (c.proprio_dim,)),
            slot("text_ids", (c.max_text_len,), torch.int64),
            slot("text_mask", (c.max_text_len,), torch.bool),
            slot("kv", (c.depth, 2, c.kv_heads, c.frame_tokens, c.head_dim), model.dtype),
            slot("noise", (c.horizon, c.action_dim)),
            slot("actions", (c.horizon, c.action_dim)),
        ],
        n,
        "cuda",
        deployment="lerobot-golden",
    )


def step(model: FlowPolicy, b: BufferSet) -> None:
    """Encode the observation into ``kv`` and denoise ``noise`` into ``actions``, in place."""
    n = b.num_slots
    frame = torch.zeros(n, dtype=torch.int64, device="cuda")
    valid = torch.ones(n, dtype=torch.bool, device="cuda")
    with torch.no_grad():
        model.encode_frame(b["image"], b["proprio"], frame, [], kv_out=b["kv"], text=(b["text_ids"], b["text_mask"]))
        prefix = [(b["kv"], model.frame_mask(valid, b["text_mask"]))]
        b["actions"].copy_(model.sample(b["noise"], prefix, frame))


def fill(b: BufferSet, g: dict[str, torch.Tensor]) -> None:
    b["image"].copy_(g["images"])
    b["proprio"][:, : g["state"].shape[1]].copy_(g["state"])
    b["text_ids"].copy_(g["text_ids"])
    b["text_mask"].copy_(g["text_mask"])
    b["noise"].copy_(g["noise"])


def error(model: FlowPolicy, actions: torch.Tensor, g) -> float:
    got, want = model.normalize_actions(actions).cpu(), g["actions_normalized"]
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_graph_replay_is_within_bf16_rounding_of_lerobot(tmp_path, monkeypatch, kind):
    g, _ = golden(kind)
    model = load_converted(kind, tmp_path, device="cuda", dtype=torch.bfloat16)
    eager, graphed = buffers(model, 2), buffers(model, 2)
    for b in (eager, graphed):
        fill(b, g)
    step(model, eager)
    graph = Graph(f"{kind}-golden").bind(graphed)
    graph.capture(2, lambda: step(model, graphed))
    graph.replay(2)
    torch.cuda.synchronize()
    assert torch.equal(eager.slot_arena, graphed.slot_arena)
    assert error(model, graphed["actions"], g) < BF16_TOL

    # the mutation: pi0 without Gemma's 1 + w norm scale, pi0.5 without adaRMS's 1 + scale
    if kind == "pi05":
        modulation = AdaRMSNorm.modulation
        unit = torch.tensor([[1.0], [0.0], [0.0]], device="cuda")
        monkeypatch.setattr(AdaRMSNorm, "modulation", lambda self, c: modulation(self, c) - unit)
    options = {"norm_plus_one": False} if kind == "pi0" else {}
    wrong = FlowPolicy(dataclasses.replace(model.cfg, **options)).to("cuda", torch.bfloat16).eval()
    wrong.load_state_dict(model.state_dict())
    fill(eager, g)
    step(wrong, eager)
    assert error(wrong, eager["actions"], g) > 5 * BF16_TOL
