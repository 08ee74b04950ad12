"""pi0's layout (images then language in block B, the state as the expert's first token) through
the static-buffer pipeline and the env.

The converted LeRobot fixture runs through the pipeline's stages (instruction table, observation
encode, denoise) and lands on LeRobot's actions; captured stages equal direct calls; a snapshot
restores byte-identical actions, and restoring everything but the language diverges (the
language lives in block B, so it is state). The env takes a pi0-layout weights folder and runs
its verbs.
"""

import json

import numpy as np
import pytest
import torch

from flashrt.policies import FlowPolicy, InstructionTable, PolicyPipeline, policy_specs, save
from flashrt.policies.tokenizer import PaliGemmaTokenizer
from flashrt.runtime import BufferSet, restore, snapshot
from flashrt_gym import FlashRTVectorEnv
from tests.policies.golden import FIXTURES, TOL, golden, load_converted, relative_error
from tests.policies.small import capture, config


@pytest.fixture(scope="module")
def pi0(tmp_path_factory) -> FlowPolicy:
    return load_converted("pi0", tmp_path_factory.mktemp("pi0"))


def fed(model: FlowPolicy, g, meta) -> PolicyPipeline:
    """A pipeline of the fixture's two samples: instructions from a table, the fixture's frame."""
    p = PolicyPipeline(model, BufferSet(policy_specs(model), 2, "cpu", deployment="test"))
    p.set_text(InstructionTable(model, json.loads(meta["tasks"])), torch.arange(2))
    p.begin_episode()
    p["image"].copy_(g["images"])
    p["proprio"][:, : g["state"].shape[1]].copy_(g["state"])
    p["noise"].copy_(g["noise"])
    return p


def test_the_pipeline_reproduces_lerobot(pi0):
    g, meta = golden("pi0")
    p = fed(pi0, g, meta)
    assert "policy.kv_text" not in p.bufs  # no block A: the language is part of block B
    assert torch.equal(p["text_ids"], g["text_ids"])
    p.encode_instruction()  # nothing to do, and harmless
    p.encode_observation()
    p.denoise()
    assert relative_error(pi0.normalize_actions(p["actions"]), g["actions_normalized"]) <= TOL


def test_captured_stages_equal_direct_calls_and_restores_are_exact(pi0):
    g, meta = golden("pi0")
    direct, graphed = fed(pi0, g, meta), fed(pi0, g, meta)
    replay = capture(graphed)
    for step in range(2):
        for p in (direct, graphed):
            p["image"].copy_(g["images"].roll(step, 1))
        direct.encode_observation()
        direct.draw_noise()
        direct.denoise()
        for stage in ("encode_observation", "draw_noise", "denoise"):
            replay(stage)
        assert torch.equal(direct.bufs.slot_arena, graphed.bufs.slot_arena)
    names = [n for n in direct.bufs.names("slot") if n not in ("policy.text_ids", "policy.text_mask")]
    cap, without_text = snapshot(direct.bufs), snapshot(direct.bufs, names=names)

    def next_actions() -> torch.Tensor:
        direct.encode_observation()
        direct.denoise()
        return direct["actions"].clone()

    want = next_actions()
    other = InstructionTable(pi0, ["open the drawer", "close it"])
    direct.set_text(other, torch.arange(2))
    assert not torch.equal(next_actions(), want)
    restore(direct.bufs, cap)
    assert torch.equal(next_actions(), want)
    # the mutation: block B is encoded from the language, so a restore without it diverges
    direct.set_text(other, torch.arange(2))
    restore(direct.bufs, without_text)
    assert not torch.allclose(next_actions(), want)


def test_pi05_prompts_are_assembled_on_the_device_as_lerobot_tokenizes_them(tmp_path):
    """pi0.5's prompt holds the frame's discretised state: encode_observation assembles it from
    the instruction's part and the state (captured, it equals the direct call), giving LeRobot's
    token ids and actions; a tokenizer that does not split the prompt at the state is refused."""
    model = load_converted("pi05", tmp_path)
    g, meta = golden("pi05")
    direct, graphed = fed(model, g, meta), fed(model, g, meta)
    assert not torch.equal(direct["text_ids"], g["text_ids"])  # the instruction's part only
    replay = capture(graphed)
    direct.encode_observation()
    direct.denoise()
    replay("encode_observation")
    replay("denoise")
    assert torch.equal(direct.bufs.slot_arena, graphed.bufs.slot_arena)
    assert torch.equal(direct["prompt_ids"], g["text_ids"]) and torch.equal(direct["prompt_mask"], g["text_mask"])
    assert relative_error(model.normalize_actions(direct["actions"]), g["actions_normalized"]) <= TOL
    tok = model.tokenizer
    whole = tok.sp.encode  # the mutation: a tokenizer that segments the whole prompt otherwise than its parts
    tok.sp.encode = lambda text: whole(text.replace(";\nAction", "; Action")) if "Task:" in text else whole(text)
    with pytest.raises(ValueError, match="does not split pi0.5's prompt"):
        InstructionTable(model, ["open the drawer"])


def pi0_layout_weights(folder) -> tuple:
    """A random pi0-layout policy at the tabletop's shapes (one 64x64 camera, 2-D actions padded
    to 8, the fixture's SentencePiece tokenizer), saved to ``folder``."""
    cfg = config(
        image_size=64, vocab=(), max_text_len=24, n_obs_steps=1, proprio_dim=8, action_dim=8, dataset_action_dim=2,
        prefix_order="images_first", state_token="suffix", norm_plus_one=True, time_dtype="float32",
        action_norm="mean_std", tokenizer="paligemma", vocab_size=400,
    )  # fmt: skip
    torch.manual_seed(0)
    model = FlowPolicy(cfg)
    model.tokenizer = PaliGemmaTokenizer((FIXTURES / "tokenizer.model").read_bytes(), cfg.max_text_len)
    return save(model, folder), cfg


def steps(env: FlashRTVectorEnv, cfg, count: int) -> list:
    out = []
    for i in range(count):
        action = np.full((env.num_envs, cfg.horizon * cfg.action_dim), 0.5 - 0.3 * i, dtype=np.float32)
        out.append(env.step(action)[:4])
    return out


def same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_the_env_runs_a_pi0_layout_policy(tmp_path):
    """FlashRTVectorEnv behind a pi0-layout weights folder: reset, step, and a restore replays
    the same steps byte for byte."""
    folder, cfg = pi0_layout_weights(tmp_path / "w")
    env = FlashRTVectorEnv(2, weights=folder, device="cpu", obs_mode="features", graphs=False)
    assert env.single_action_space.shape == (cfg.horizon * cfg.action_dim,)
    obs, _ = env.reset(seed=3)
    assert obs.shape == (2, cfg.width + 2) and np.isfinite(obs).all()
    cap = env.snapshot()
    first = steps(env, cfg, 2)
    env.restore(cap)
    assert same(steps(env, cfg, 2), first)
    env.close()


@pytest.mark.cuda
def test_the_env_with_a_pi0_layout_policy_replays_its_graph_as_eager(tmp_path):
    """On CUDA (bf16, Triton kernels): the captured env step equals the eager one byte for byte,
    a restore and a fork replay the same steps."""
    folder, cfg = pi0_layout_weights(tmp_path / "w")
    runs = []
    for graphs in (False, True):
        env = FlashRTVectorEnv(4, weights=folder, device="cuda", obs_mode="features", graphs=graphs)
        env.reset(seed=7)
        cap = env.snapshot()
        first = steps(env, cfg, 3)
        env.restore(cap)
        assert same(steps(env, cfg, 3), first)
        env.restore(cap)
        env.fork(0, [1, 2, 3])
        forked = steps(env, cfg, 1)[0]
        assert all(np.array_equal(x[0], x[i]) for x in forked[:2] for i in (1, 2, 3))
        runs.append(first)
        env.close()
    assert same(*runs)
