"""Meta-World behind the external-simulator verbs: exact capsules on every MT10 task (restore into a
fresh simulator continues byte for byte; without the model rows or the Python fields it departs),
fork, refused rows, the MuJoCo 4 shim, Meta-World's success rule, and the registered ids."""

import hashlib
import json

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("metaworld", reason="Meta-World is installed by scripts/install_metaworld.sh")

import mujoco
from metaworld.env_dict import ALL_V3_ENVIRONMENTS, MT10_V3

import flashrt_gym  # noqa: F401  (registers the ids)
from flashrt_gym.sims.metaworld_cpu import HEAD, MetaWorld
from flashrt_gym.sims.metaworld_state import (
    WELD_DATA,
    Views,
    dump_fields,
    encode,
    load_fields,
    reset_mocap_welds,
    write_fields,
)
from flashrt_gym.sims.metaworld_tasks import EPISODE_STEPS, INSTRUCTIONS, MT10

N = len(MT10)


def started(slots: int = N) -> MetaWorld:
    """An MT10 simulator (slot i runs task i % 10), seeded, reset and a few chunks in."""
    sim = MetaWorld(slots)
    sim.seed(np.arange(slots) + 40)
    sim.reset()
    rng = np.random.default_rng(1)
    for _ in range(2):
        sim.run_ticks(rng.uniform(-1, 1, (slots, 4, 4)))
    return sim


def continuation(sim: MetaWorld, count: int = 2) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """Per slot, the bytes of what the next ``count`` chunks, a reset and one more chunk give
    (rewards, observations, the camera's frames), and the state rows along the way."""
    rng = np.random.default_rng(7)
    outputs: list[list[bytes]] = [[] for _ in range(sim.num_slots)]
    rows: list[list[bytes]] = [[] for _ in range(sim.num_slots)]

    def record(*arrays: np.ndarray) -> None:
        state = sim.get_state()
        for i in range(sim.num_slots):
            outputs[i] += [a[i].tobytes() for a in arrays]
            rows[i].append(state[i].tobytes())

    for _ in range(count):
        dense, sparse = sim.run_ticks(rng.uniform(-1, 1, (sim.num_slots, 4, 4)))
        record(dense, sparse, sim.observation(), sim.render())
    sim.reset()
    dense, sparse = sim.run_ticks(rng.uniform(-1, 1, (sim.num_slots, 4, 4)))
    record(dense, sparse, sim.observation())
    return outputs, rows


def test_restore_into_a_fresh_simulator_continues_byte_for_byte_and_partial_rows_depart():
    """Every MT10 task: a fresh simulator given the source's rows continues as the source does,
    through a reset (the reset RNG travels in the Python fields). Restoring all but the model rows
    (the restoring instance's fixtures and goal marker stay) or all but the Python fields (its
    target, previous observation, path length and RNG stay) departs on every task."""
    source, sim = started(), MetaWorld(N)
    sim.seed(np.arange(N) + 1000)  # the restoring simulator runs episodes of its own streams
    sim.reset()
    own_rows = list(sim._rows)  # each slot's episode rows of its task's (shared) model
    own_fields = [dump_fields(e, v) for e, v in zip(sim.envs, sim._views, strict=True)]
    rows = source.get_state()
    sim.set_state(None, rows)
    assert np.array_equal(sim.get_state(), rows)
    for e in sim.envs:  # the live views are the restoring instance's own memory
        assert np.shares_memory(e.init_left_pad, e.data.xpos) and np.shares_memory(e.init_right_pad, e.data.xpos)
    got, want = continuation(sim), continuation(source)
    assert got == want

    sim.set_state(None, rows)  # without the model rows: its own stay
    sim._rows[:] = own_rows
    no_model, _ = continuation(sim)
    sim.set_state(None, rows)  # without the Python fields: its own stay
    for e, v, raw in zip(sim.envs, sim._views, own_fields, strict=True):
        write_fields(e, load_fields(raw, v))
    no_fields, _ = continuation(sim)
    for name, a, b, c in zip(MT10, want[0], no_model, no_fields, strict=True):
        assert a != b, f"{name}: the model rows made no difference"
        assert a != c, f"{name}: the Python fields made no difference"


def test_slots_of_a_task_share_one_model_and_run_as_if_alone():
    """Slots i and i + 10 of MT10 run one task on one MuJoCo model of this process (about 19 MB a
    slot saved), each with its own episode's rows of it: stepped by two threads, each slot gives
    the rewards, observations, physics and frames of a simulator holding that slot alone. Mutation: a
    slot stepped on the rows the task's last slot left (not its own) departs."""

    class Stale(MetaWorld):
        def _load(self, i):
            env = self.envs[i]
            env.model = self._classes[self.task_names[int(self.task[i])]]._shared_model
            return env

    def run(sim: MetaWorld, seeds: np.ndarray, actions: list[np.ndarray]) -> list[list[bytes]]:
        sim.seed(seeds)
        sim.reset()
        out = [[] for _ in range(sim.num_slots)]
        for a in actions:
            dense, _ = sim.run_ticks(a)
            frames = sim.render()  # the goal marker is a site the episode's rows place
            for i, env in enumerate(sim.envs):
                physics = np.empty(mujoco.mj_stateSize(env.model, mujoco.mjtState.mjSTATE_INTEGRATION))
                mujoco.mj_getState(env.model, env.data, physics, mujoco.mjtState.mjSTATE_INTEGRATION)
                out[i] += [dense[i].tobytes(), sim.observation()[i].tobytes(), physics.tobytes(), frames[i].tobytes()]
        return out

    seeds = np.arange(2 * N) + 500
    rng = np.random.default_rng(3)
    actions = [rng.uniform(-1, 1, (2 * N, 4, 4)) for _ in range(3)]
    shared = MetaWorld(2 * N)
    assert shared.envs[0].model is shared.envs[N].model and shared.envs[0].model is not shared.envs[1].model
    got = run(MetaWorld(2 * N, threads=2), seeds, actions)
    stale = run(Stale(2 * N), seeds, actions)
    for i in (0, N, 3, N + 3, 8, N + 8):  # reach, drawer-close and window-open, two slots each
        alone = run(MetaWorld(1, MT10[i % N]), seeds[i : i + 1], [a[i : i + 1] for a in actions])
        assert got[i] == alone[0], f"slot {i} ({MT10[i % N]})"
        if i < N:  # the task's first slot steps on its second's episode rows when they are not its own
            assert stale[i] != alone[0], f"slot {i} ({MT10[i % N]}): the shared rows made no difference"


@pytest.fixture(scope="module")
def pair() -> MetaWorld:
    """Two slots of each MT10 task: slot i and i + 10 share a task."""
    return started(2 * N)


def test_fork_with_equal_actions_stays_identical(pair):
    """Slot i's row forked into slot i + 10 (the same task): equal actions give the same bytes in
    both, through the next reset drawn from the same stream; reseeded, they part."""
    lo, hi = np.arange(N), np.arange(N, 2 * N)
    pair.set_state(hi, pair.get_state(lo))
    rng = np.random.default_rng(3)
    for k in range(3):
        a = rng.uniform(-1, 1, (N, 4, 4))
        dense, sparse = pair.run_ticks(np.concatenate([a, a]))
        if k == 1:
            pair.reset()
        obs, img, rows = pair.observation(), pair.render(), pair.get_state()
        for x in (dense, sparse, obs, img, rows):
            assert np.array_equal(x[lo], x[hi])
    pair.seed(np.arange(N) + 500, hi)  # reseeded branches draw other episodes, on every task
    pair.reset()
    obs = pair.observation()
    assert all(not np.array_equal(obs[i], obs[i + N]) for i in lo)


def test_refused_rows_change_nothing(pair):
    """A corrupted row (its checksum), a forged one (another layout's tag, non-finite physics,
    undecodable Python fields, its checksum made to match), another task's row, a row of another
    simulator (MT1) and a batch with one bad row are refused, naming the problem, before any slot
    changes: the good row in the batch is not written either."""
    before = pair.get_state()
    good = before[[1]]

    def forged(edit) -> np.ndarray:
        row = before[[0]].copy()
        edit(row[0])
        row[0, -32:] = np.frombuffer(hashlib.sha256(row[0, :-32].tobytes()).digest(), np.uint8)
        return row

    physics_at = pair._physics_at
    cases = {
        "checksum": before[[0]].copy(),
        "another simulator": forged(lambda r: r[:8].view(np.int64).__setitem__(0, 12345)),
        "non-finite": forged(lambda r: r[physics_at : physics_at + 8].view(np.float64).__setitem__(0, np.nan)),
        "Python fields": forged(lambda r: r.__setitem__(slice(8 * len(HEAD) + 8 * 39, 8 * len(HEAD) + 8 * 39 + 2), 0)),
    }
    cases["checksum"][0, physics_at + 3] ^= 1
    for words, row in cases.items():
        with pytest.raises(ValueError, match=words):
            pair.set_state([0], row)
    with pytest.raises(ValueError, match="restore rows into slots of their own task"):
        pair.set_state([2], good)
    with pytest.raises(ValueError, match="slot 0 .* non-finite"):
        pair.set_state([11, 0], np.concatenate([good, cases["non-finite"]]))
    mt1 = MetaWorld(1, "reach-v3")
    with pytest.raises(ValueError, match="rows of get_state"):
        pair.set_state([0], mt1.get_state())
    assert np.array_equal(pair.get_state(), before)


def test_the_shim_writes_mujoco_3s_weld_numbers_and_keeps_mujoco_4s_rest():
    """Meta-World 3.1.1's own ``reset_mocap_welds`` fails on MuJoCo 4 (12 numbers a weld, not 11);
    the shim writes the 11 and leaves the 12th as compiled."""
    cls = ALL_V3_ENVIRONMENTS["reach-v3"]
    if mujoco.mjNEQDATA > len(WELD_DATA):
        with pytest.raises(ValueError, match="broadcast"):
            cls()
    env = type(cls.__name__, (cls,), {"reset_mocap_welds": reset_mocap_welds})()
    compiled = mujoco.MjModel.from_xml_path(env.fullpath)
    welds = np.flatnonzero(env.model.eq_type == mujoco.mjtEq.mjEQ_WELD)
    assert welds.size
    assert np.array_equal(env.model.eq_data[welds, : len(WELD_DATA)], np.tile(WELD_DATA, (welds.size, 1)))
    assert np.array_equal(env.model.eq_data[welds, len(WELD_DATA) :], compiled.eq_data[welds, len(WELD_DATA) :])


def test_the_field_rule_finds_the_episode_state_and_refuses_what_it_cannot_hold_by_name():
    """The rule takes the task's episode fields (the reset RNG among them) by value, the pads'
    live views of ``data.xpos`` as references, and leaves MuJoCo's structures out; a field of a
    type it does not know is refused with its name, not dropped."""
    sim = MetaWorld(1, "reach-v3")
    sim.seed(np.array([4]))
    sim.reset()
    env = sim.envs[0]
    tree = json.loads(dump_fields(env, Views(env)))
    assert {"_target_pos", "_prev_obs", "obj_init_pos", "curr_path_length", "_last_rand_vec"} <= set(tree)
    assert "rng" in tree["_np_random"] and "nd" in tree["_target_pos"]
    assert tree["init_left_pad"]["view"][:2] == ["data", "xpos"]
    assert not {"model", "data", "action_space", "mujoco_renderer"} & set(tree)
    with pytest.raises(TypeError, match="field extra"):
        encode(object(), Views(env), "extra")
    vars(env)["extra"] = object()
    with pytest.raises(TypeError, match="field extra"):
        sim.get_state()


def test_metaworld_success_rule_freezes_the_slot_and_the_expert_reaches_it():
    """Meta-World's scripted reach policy succeeds within its horizon; ``info["success"]`` sets
    the flag, the slot is frozen (its state no longer moves) and the sparse reward stops."""
    sim = MetaWorld(2, "reach-v3")
    sim.seed(np.array([5, 6]))
    sim.reset()
    for _ in range(40):
        dense, sparse = sim.run_ticks(np.stack([sim.expert()] * 4, axis=1))
        if sim.success().all():
            break
    assert sim.success().all()
    rows = sim.get_state()
    dense, sparse = sim.run_ticks(np.ones((2, 4, 4)))
    assert np.array_equal(sim.get_state(), rows) and not dense.any() and not sparse.any()


def test_task_tables_and_registered_ids_match_metaworld():
    """The instruction table covers Meta-World's 50 tasks, MT10 is Meta-World's own, and each
    task and MT10 has an id."""
    assert list(INSTRUCTIONS) == list(ALL_V3_ENVIRONMENTS)
    assert list(MT10) == list(MT10_V3)
    assert len(set(INSTRUCTIONS.values())) == len(INSTRUCTIONS)
    ids = set(gym.registry)
    assert "FlashRT-MetaWorld-MT10-v0" in ids
    assert all(f"FlashRT-MetaWorld-{n.removesuffix('-v3')}-v0" in ids for n in INSTRUCTIONS)
    ours = [i for i in ids if i.startswith("FlashRT-MetaWorld-")]
    assert len(ours) == 51 and {gym.spec(i).max_episode_steps for i in ours} == {EPISODE_STEPS}
    assert gym.spec("FlashRT-MetaWorld-MT10-v0").vector_entry_point.keywords["max_episode_steps"] == EPISODE_STEPS == 50


@pytest.fixture(scope="module")
def micro_metaworld(tmp_path_factory) -> str:
    """A random one-layer policy of Meta-World's shapes (4-D actions and proprioception, all 50
    tasks' words): fast, and for any task (the shipped MT10 policy is tested in test_pretrained.py)."""
    from dataclasses import replace

    import torch

    from flashrt.policies import FlowPolicy, save
    from flashrt.policies.config import tiny

    vocab = sorted({w for text in INSTRUCTIONS.values() for w in text.split()})
    cfg = replace(
        tiny(vocab), action_dim=4, proprio_dim=4,
        width=64, depth=1, heads=2, head_dim=32, mlp=128, vision_width=64, vision_depth=1, vision_heads=2,
        vision_mlp=128, expert_width=64, expert_mlp=128, steps=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return str(save(FlowPolicy(cfg), tmp_path_factory.mktemp("micro_metaworld")))


def test_mt10_tasks_name_the_shipped_policy_and_other_tasks_must_bring_weights():
    """The env loads the shipped MT10 policy for MT10 and each of its tasks when given no weights;
    no shipped policy knows the instructions of the other 40 tasks, and the env asks for weights."""
    from flashrt_gym.assets import TINY_METAWORLD

    assert MetaWorld(2).pretrained_weights == MetaWorld(1, tasks="reach-v3").pretrained_weights == TINY_METAWORLD
    assert MetaWorld(1, tasks=["reach-v3", "basketball-v3"]).pretrained_weights is None
    with pytest.raises(ValueError, match="dunk the ball into the basket.*pass weights="):
        gym.make("FlashRT-MetaWorld-basketball-v0", device="cpu")


def test_registered_ids_pass_gymnasiums_env_checker_and_step_as_vector_envs(micro_metaworld):
    """``gym.make`` of an MT1 id passes Gymnasium's env checker; ``gym.make_vec`` of MT10 steps
    and reports Meta-World's success per slot."""
    from gymnasium.utils.env_checker import check_env

    env = gym.make("FlashRT-MetaWorld-drawer-open-v0", weights=micro_metaworld, device="cpu")
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    env.close()
    envs = gym.make_vec(
        "FlashRT-MetaWorld-MT10-v0", num_envs=N, vectorization_mode="vector_entry_point", weights=micro_metaworld,
        device="cpu", max_episode_steps=3,
    )  # fmt: skip
    obs, _ = envs.reset(seed=0)
    for k in range(3):
        obs, reward, _, truncated, _ = envs.step(envs.action_space.sample())
        assert obs.shape[0] == N and np.isfinite(reward).all() and truncated.all() == (k == 2)
    envs.close()


def test_threads_step_the_same_bytes_as_one():
    """Slots stepped and reset on two threads give the bytes one thread gives."""
    runs = []
    for threads in (1, 2):
        sim = MetaWorld(4, ["push-v3", "drawer-open-v3"], threads=threads)
        sim.seed(np.arange(4) + 9)
        sim.reset()
        rng = np.random.default_rng(2)
        out = [sim.run_ticks(rng.uniform(-1, 1, (4, 4, 4))) for _ in range(3)]
        sim.reset()
        runs.append([*(x.tobytes() for pair in out for x in pair), sim.get_state().tobytes()])
    assert runs[0] == runs[1]


def test_the_lean_renderer_draws_the_frames_of_meta_worlds_full_context():
    """The renderer drops the shadow map and the 640x480 offscreen buffer Meta-World's models ask
    for (shadows are off): every pixel is what a context with both draws, on three MT10 tasks."""
    import copy

    sim = MetaWorld(3)
    sim.seed(np.arange(3) + 7)
    sim.reset()
    lean = sim.render()[:, 0]
    for i, env in enumerate(sim.envs):
        r, cam, _ = sim._renderer(i)
        assert r.model.vis.quality.shadowsize == 0 and env.model.vis.quality.shadowsize == 4096
        model = copy.deepcopy(env.model)
        model.vis.quality.offsamples = 0
        full = mujoco.Renderer(model, sim.image_size, sim.image_size)
        full.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = full.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        full.update_scene(env.data, cam)
        assert np.array_equal(full.render(), lean[i])
        full.close()


def test_upside_down_scene_cameras_are_turned_the_right_way_up():
    """The scenes' ``corner`` cameras look with their image's up axis pointing down: their frames
    come turned by 180 degrees (the raw frame differs), the ``topview`` camera's as rendered."""
    for camera, turned in (("corner", True), ("corner3", True), ("topview", False)):
        sim = MetaWorld(1, "drawer-open-v3", camera=camera, image_size=32)
        sim.seed(np.array([3]))
        sim.reset()
        r, cam, flip = sim._renderer(0)
        assert flip == turned
        r.update_scene(sim.envs[0].data, cam)
        raw = r.render().copy()
        frame = sim.render()[0, 0]
        assert np.array_equal(frame, raw[::-1, ::-1] if turned else raw)
        assert np.array_equal(frame, raw) != turned


def test_slots_come_in_runs_of_one_task_and_fork_within_a_run():
    """``block=2``: slots 0, 1 run push, 2, 3 reach; a row forks into its run, not across."""
    sim = MetaWorld(4, ["push-v3", "reach-v3"], block=2)
    assert sim.task.tolist() == [0, 0, 1, 1] and sim.instruction().tolist() == [0, 0, 1, 1]
    sim.seed(np.arange(4))
    sim.reset()
    sim.set_state([1], sim.get_state([0]))
    with pytest.raises(ValueError, match="restore rows into slots of their own task"):
        sim.set_state([2], sim.get_state([0]))
    with pytest.raises(ValueError, match="block must be an int >= 1"):
        MetaWorld(1, "reach-v3", block=0)


def test_env_capsules_restore_the_policy_and_meta_world_together(micro_metaworld):
    """Through the env's verbs: snapshot, steps (an episode ends and the slot autoresets), restore,
    the same steps again give the same bytes; a fork into a slot of the same task repeats it."""
    envs = gym.make_vec(
        "FlashRT-MetaWorld-push-v0", num_envs=2, vectorization_mode="vector_entry_point", weights=micro_metaworld,
        device="cpu", max_episode_steps=2,
    ).unwrapped  # fmt: skip
    envs.reset(seed=3)
    rng = np.random.default_rng(0)
    actions = [rng.uniform(-1, 1, envs.action_space.shape).astype(np.float32) for _ in range(3)]

    def run() -> list[bytes]:
        return [np.asarray(x).tobytes() for a in actions for x in envs.step(a)[:4]]

    cap = envs.snapshot()
    want = run()
    envs.restore(cap)
    assert run() == want
    envs.fork(0, [1])
    same = [rng.uniform(-1, 1, envs.action_space.shape[1:]).astype(np.float32)] * 2
    obs, reward, *_ = envs.step(np.stack(same))
    assert np.array_equal(obs[0], obs[1]) and reward[0] == reward[1]


def test_processes_give_one_processs_bytes_and_restore_all_or_nothing():
    """``processes=2``: shards of slots 0-1 and 2-4, the second's first slot running task 2 % 3 as
    in one simulator; seeds, resets, steps, frames and rows are one process's bytes. A set of rows
    that one shard refuses (a corrupted row of slot 4) changes no slot of either shard, though the
    other shard had written its own. Mutation: the shard built without its first slot offset
    runs other tasks."""
    from flashrt_gym.sims import metaworld

    tasks = ["push-v3", "drawer-open-v3", "reach-v3"]
    one, sharded = MetaWorld(5, tasks), metaworld(5, tasks, processes=2)
    try:
        assert sharded.bounds.tolist() == [0, 2, 5] and sharded.identity() == one.identity()
        offset = MetaWorld(3, tasks, first_slot=2).task.tolist()
        assert MetaWorld(3, tasks).task.tolist() != one.task[2:].tolist() == offset
        rng = np.random.default_rng(3)
        actions = [rng.uniform(-1, 1, (5, 4, 4)) for _ in range(3)]
        runs = []
        for sim in (one, sharded):
            sim.seed(np.arange(5) + 21)
            sim.reset()
            out = [x.tobytes() for a in actions[:2] for x in sim.run_ticks(a)]
            sim.reset(np.array([True, False, False, True, False]))
            out += [x.tobytes() for x in sim.run_ticks(actions[2])]
            out += [sim.render().tobytes(), sim.observation().tobytes(), sim.instruction().tobytes()]
            runs.append([*out, sim.get_state().tobytes(), sim.get_state(np.array([4, 0])).tobytes()])
        assert runs[0] == runs[1]
        before = sharded.get_state()
        other = MetaWorld(5, tasks)
        other.seed(np.arange(5) + 500)
        other.reset()
        rows = other.get_state()
        assert not np.array_equal(rows[:2], before[:2])  # shard 0 would change if nothing undid it
        rows[4, 100] ^= 1
        with pytest.raises(ValueError, match=r"shard 1 \(slots 2 to 4.*slot 2 is refused: its checksum"):
            sharded.set_state(None, rows)
        assert np.array_equal(sharded.get_state(), before)
    finally:
        sharded.close()
    assert isinstance(metaworld(1, tasks, processes=4), MetaWorld)  # at most one process a slot
