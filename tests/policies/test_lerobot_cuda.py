"""Converted pi0 / pi0.5 in bf16 under CUDA graph replay, against LeRobot's float32 golden actions
(run on the GPU machine: pytest -m cuda).

The pipeline's observation encode and denoising are captured once as a graph and replayed:
replay must equal the eager bf16 run byte for byte and land within bf16 rounding of LeRobot's
float32 result; with Gemma's ``1 + w`` norm scale (pi0) or adaRMS's ``1 + scale`` (pi0.5)
switched off the same comparison must fail.
"""

import dataclasses
import json

import pytest
import torch

from flashrt.policies import FlowPolicy, InstructionTable, PolicyPipeline, policy_specs
from flashrt.policies.layers import AdaRMSNorm
from flashrt.runtime import BufferSet, Graph
from tests.policies.golden import KINDS, golden, load_converted

pytestmark = pytest.mark.cuda

BF16_TOL = 0.03
"""||bf16 - fp32|| / ||fp32|| allowed: bf16 keeps 8 bits of mantissa (2^-9 = 0.002 per rounding),
and the error of a few layers and ten Euler steps compounds to ~1e-2; a wrong option is O(0.1-1)."""


def fed(model: FlowPolicy, g, meta) -> PolicyPipeline:
    """The pipeline over the fixture's two samples: their instructions (pi0.5's prompts are
    assembled with the state on the device), the frame, the noise."""
    p = PolicyPipeline(model, BufferSet(policy_specs(model), 2, "cuda", deployment="lerobot-golden"))
    p.begin_episode()
    p.set_text(InstructionTable(model, json.loads(meta["tasks"])), torch.arange(2, device="cuda"))
    p["image"].copy_(g["images"])
    p["proprio"][:, : g["state"].shape[1]].copy_(g["state"])
    p["noise"].copy_(g["noise"])
    return p


def step(p: PolicyPipeline) -> None:
    p.encode_observation()
    p.denoise()


def error(model: FlowPolicy, actions: torch.Tensor, g) -> float:
    got, want = model.normalize_actions(actions).cpu(), g["actions_normalized"]
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_graph_replay_is_within_bf16_rounding_of_lerobot(tmp_path, monkeypatch, kind):
    g, meta = golden(kind)
    model = load_converted(kind, tmp_path, device="cuda", dtype=torch.bfloat16)
    eager, graphed = fed(model, g, meta), fed(model, g, meta)
    step(eager)
    graph = Graph(f"{kind}-golden").bind(graphed.bufs)
    graph.capture(2, lambda: step(graphed))
    graph.replay(2)
    torch.cuda.synchronize()
    assert torch.equal(eager.bufs.slot_arena, graphed.bufs.slot_arena)
    assert error(model, graphed["actions"], g) < BF16_TOL

    # the mutation: pi0 without Gemma's 1 + w norm scale, pi0.5 without adaRMS's 1 + scale
    if kind == "pi05":
        modulation = AdaRMSNorm.modulation
        unit = torch.tensor([[1.0], [0.0], [0.0]], device="cuda")
        monkeypatch.setattr(AdaRMSNorm, "modulation", lambda self, c: modulation(self, c) - unit)
    options = {"norm_plus_one": False} if kind == "pi0" else {}
    wrong = FlowPolicy(dataclasses.replace(model.cfg, **options)).to("cuda", torch.bfloat16).eval()
    wrong.load_state_dict(model.state_dict())
    wrong.tokenizer = model.tokenizer
    p = fed(wrong, g, meta)
    step(p)
    assert error(wrong, p["actions"], g) > 5 * BF16_TOL
