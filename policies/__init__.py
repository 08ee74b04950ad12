"""The VLA flow policy: a pi0-shaped model, its static-buffer pipeline, and its weights."""

from flashrt.policies.config import PRESETS, PolicyConfig, pi0, tiny
from flashrt.policies.model import FlowPolicy
from flashrt.policies.pipeline import InstructionTable, PolicyPipeline, PolicyState, deployment_digest, policy_specs
from flashrt.policies.tokenizer import WordTokenizer
from flashrt.policies.weights import WeightsError, load, save, tokenizer_for

__all__ = [
    "PRESETS",
    "FlowPolicy",
    "InstructionTable",
    "PolicyConfig",
    "PolicyPipeline",
    "PolicyState",
    "WeightsError",
    "WordTokenizer",
    "deployment_digest",
    "load",
    "pi0",
    "policy_specs",
    "save",
    "tiny",
    "tokenizer_for",
]
