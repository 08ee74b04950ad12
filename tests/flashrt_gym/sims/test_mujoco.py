"""The MuJoCo push scene and its CPU simulator: the task matches the tabletop's, and a slot's
state row is a complete capsule of it (exact restore, fork, all-or-nothing writes), while
position and velocity alone are not (the ablation)."""

import copy
import dataclasses
import math

import mujoco
import numpy as np
import pytest
import torch

from flashrt.runtime import BufferSet
from flashrt_gym.sims import SCENE, MujocoPush, PushConfig, load_scene
from flashrt_gym.sims.push.mujoco_cpu import STATE_SIG, TASK_FIELDS
from flashrt_gym.sims.push.task import VIEWS, View
from flashrt_gym.sims.tabletop import GOALS, Tabletop, TabletopConfig
from flashrt_gym.sims.tabletop.tabletop import COLORS, EE_COLOR, GOAL_COLOR


def make(n: int, seed: int = 0, **table) -> MujocoPush:
    sim = MujocoPush(n, PushConfig(TabletopConfig(**table)) if table else None)
    sim.seed(np.arange(n) + seed)
    sim.reset()
    return sim


def noisy_expert(sim: MujocoPush, rng: np.random.Generator, ticks: int, noise: float = 0.3) -> np.ndarray:
    """(slots, ticks, 2) actions: the expert's for the current state plus noise, held per chunk."""
    a = sim.expert()[:, None] + noise * rng.standard_normal((sim.num_slots, ticks, 2))
    return np.clip(a, -1, 1)


def drive(sim: MujocoPush, chunks: list[np.ndarray]) -> list[tuple[np.ndarray, ...]]:
    """Run the chunks; per chunk, the rewards, success and every slot's state row after it."""
    out = []
    for a in chunks:
        dense, sparse = sim.run_ticks(a)
        out.append((dense, sparse, sim.success(), sim.get_state()))
    return out


def same(a: list[tuple[np.ndarray, ...]], b: list[tuple[np.ndarray, ...]]) -> bool:
    return all(x.tobytes() == y.tobytes() for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_scene_holds_the_tabletops_objects_and_goals_with_mass_and_friction():
    model, layout = load_scene(PushConfig())
    cfg = TabletopConfig()
    for name in cfg.goals:
        g = model.geom(f"goal_{name}")
        assert np.allclose(g.pos[:2], GOALS[name]) and g.size[0] == pytest.approx(cfg.goal_radius)
        assert g.contype[0] == 0 and g.conaffinity[0] == 0  # visual only
    for obj, fp in zip(cfg.objects, layout.footprints, strict=True):
        body = model.body(obj.replace(" ", "_"))
        assert body.mass[0] > 0 and fp.radius <= cfg.obj_radius
        assert model.geom(obj.replace(" ", "_")).friction[0] > 0
    kinds = [fp.kind for fp in layout.footprints]
    assert kinds == ["polygon", "circle", "polygon"]
    assert [len(fp.vertices) for fp in layout.footprints] == [4, 0, 3]  # the square and the prism's triangle
    assert layout.tick_seconds == pytest.approx(10 * model.opt.timestep)


def test_a_scene_that_disagrees_with_the_task_is_refused_by_name():
    with pytest.raises(ValueError, match="goal_left"):
        MujocoPush(1, PushConfig(TabletopConfig(goal_radius=0.3)))
    with pytest.raises(ValueError, match="yellow_diamond"):
        MujocoPush(1, PushConfig(TabletopConfig(objects=("red square", "yellow diamond"))))
    with pytest.raises(ValueError, match="top speed"):
        MujocoPush(1, PushConfig(TabletopConfig(max_speed=0.5)))
    with pytest.raises(ValueError, match="not a file"):
        PushConfig(scene=SCENE.with_name("missing.xml"))


def test_episode_draws_are_the_tabletops_for_the_same_seeds():
    """Same key and counter -> the tabletop's instruction and start positions; the second
    episode of each slot continues the same stream. Mutation: other seeds give other starts."""
    n = 16
    task = Tabletop(TabletopConfig())
    b = BufferSet(task.specs(), n)
    task.bind(b)
    task.seed(torch.arange(n) + 7)
    sim = make(n, seed=7)
    want = torch.empty(n, task.observation_dim)
    for episode in range(2):
        task.reset()
        if episode:
            sim.reset()
        obs = sim.observation()
        task.observation(want)
        assert np.array_equal(sim.instruction(), b["sim.instruction"].numpy())
        assert np.allclose(obs[:, :2], b["sim.ee"].numpy(), atol=1e-6)
        assert np.allclose(obs[:, 2:8], b["sim.obj"].reshape(n, -1).numpy(), atol=1e-6)
        assert np.allclose(obs, want.numpy(), atol=1e-6)
    other = make(n, seed=8)
    assert not np.allclose(other.observation()[:, 2:8], sim.observation()[:, 2:8], atol=1e-3)


def test_masked_reset_touches_only_masked_slots():
    sim = make(4)
    sim.run_ticks(np.full((4, 3, 2), 0.5))
    before = sim.get_state()
    mask = np.array([True, False, True, False])
    sim.reset(mask)
    after = sim.get_state()
    assert np.array_equal(before[~mask], after[~mask])
    assert all(before[i].tobytes() != after[i].tobytes() for i in np.flatnonzero(mask))
    counter = TASK_FIELDS.index("counter")
    fields = after[:, -8 * len(TASK_FIELDS) :].view(np.int64)
    assert fields[:, counter].tolist() == [2, 1, 2, 1]
    assert sim.ticks().tolist() == [0, 3, 0, 3]
    with pytest.raises(ValueError, match="bool array"):
        sim.reset(np.array([1, 0, 1, 0]))


def test_rewards_and_success_follow_the_tabletops_rule():
    """Dense = 5 * target progress + end-effector progress to the contact ring + 2 on success;
    sparse = -1 per tick until success; a successful slot is frozen and earns 0. Checked one
    tick at a time against the formula on the observed positions. Mutation: another progress
    weight does not match."""
    sim = make(6, seed=3)
    cfg = TabletopConfig()
    rng = np.random.default_rng(0)

    def measure(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        target, goal = obs[:, 8:11].argmax(1), obs[:, 11:15].argmax(1)
        p = obs[:, 2:8].reshape(-1, 3, 2)[np.arange(len(obs)), target]
        g = np.array([GOALS[cfg.goals[i]] for i in goal])
        ring = np.linalg.norm(obs[:, :2] - p, axis=1) - cfg.ee_radius - cfg.obj_radius
        return np.linalg.norm(p - g, axis=1), np.maximum(ring, 0)

    seen_success, mutant_fits = False, True
    for _ in range(40):
        obs0, alive = sim.observation(), ~sim.success()
        (o0, e0), action = measure(obs0), noisy_expert(sim, rng, 1, noise=0.1)
        dense, sparse = sim.run_ticks(action)
        success = sim.success()
        (o1, e1) = measure(sim.observation())
        newly = success & alive
        want = (5 * (o0 - o1) + (e0 - e1) + 2 * newly) * alive
        assert np.allclose(dense, want, atol=1e-4)
        mutant_fits &= np.allclose(dense, (4 * (o0 - o1) + (e0 - e1) + 2 * newly) * alive, atol=1e-4)
        assert np.array_equal(sparse, np.where(alive & ~success, -1.0, 0.0))
        assert np.array_equal(success, (o1 < cfg.goal_radius) | ~alive)
        assert np.array_equal(sim.observation()[~alive], obs0[~alive])  # frozen
        seen_success |= bool(newly.any())
    assert seen_success and not mutant_fits


def mid_push() -> tuple[MujocoPush, np.ndarray, list[np.ndarray], list[tuple[np.ndarray, ...]]]:
    """Three slots pushed into contact by the noisy expert, their state ``rows`` there, five more
    chunks from there and what driving them gave (the simulator is left after them)."""
    rng = np.random.default_rng(1)
    sim = make(3, seed=11)
    for _ in range(4):
        sim.run_ticks(noisy_expert(sim, rng, 2))
    rows = sim.get_state()
    chunks = [noisy_expert(sim, rng, 3) for _ in range(5)]
    return sim, rows, chunks, drive(sim, chunks)


def test_restore_and_continue_equals_the_uninterrupted_run_byte_for_byte():
    """Snapshot mid-push (contacts active), continue; restore the rows into a fresh simulator
    and continue with the same actions: every reward, success flag and state byte agrees."""
    sim, rows, chunks, want = mid_push()
    fresh = make(3, seed=99)
    fresh.set_state(None, rows)
    assert same(want, drive(fresh, chunks))
    # and back into the same simulator, over its later state
    sim.set_state([0, 1, 2], rows)
    assert same(want, drive(sim, chunks))


def test_threads_step_the_same_bytes():
    """Stepped by two threads, the mid-push snapshot continues byte for byte as it does on one; a
    thread count that is not an int >= 1 is refused by name."""
    _, rows, chunks, want = mid_push()
    threaded = MujocoPush(3, threads=2)
    threaded.set_state(None, rows)
    assert same(want, drive(threaded, chunks))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            MujocoPush(1, threads=bad)


def test_processes_step_the_same_bytes():
    """Split over two worker processes (``mujoco_push(processes=2)``), the mid-push snapshot
    continues byte for byte as it does in this one."""
    from flashrt_gym.sims import mujoco_push

    _, rows, chunks, want = mid_push()
    sharded = mujoco_push(3, processes=2)
    try:
        assert sharded.processes == 2
        sharded.set_state(None, rows)
        assert same(want, drive(sharded, chunks))
    finally:
        sharded.close()


@pytest.mark.parametrize(
    "sig",
    [
        mujoco.mjtState.mjSTATE_QPOS | mujoco.mjtState.mjSTATE_QVEL | mujoco.mjtState.mjSTATE_TIME,
        mujoco.mjtState.mjSTATE_FULLPHYSICS,
    ],
    ids=["qpos_qvel", "fullphysics_without_warmstart"],
)
def test_restoring_less_than_the_integration_state_diverges(sig):
    """The ablation: the same snapshot restored through a smaller signature (the task fields
    and everything else equal) continues differently, since the solver's warm start is lost."""
    _, rows, chunks, want = mid_push()
    partial = make(3, seed=11)
    partial.set_state(None, rows)
    for d, full in zip(partial.data, rows[:, : 8 * partial.physics_size].view(np.float64), strict=True):
        saved = np.empty(mujoco.mj_stateSize(partial.model, sig))
        donor = mujoco.MjData(partial.model)
        mujoco.mj_setState(partial.model, donor, full, STATE_SIG)
        mujoco.mj_getState(partial.model, donor, saved, sig)
        mujoco.mj_resetData(partial.model, d)
        mujoco.mj_setState(partial.model, d, saved, sig)
    got = drive(partial, chunks)
    assert not same(want, got)
    qpos = slice(8, 8 * (1 + partial.model.nq))  # after time: the positions themselves part
    assert any(want[-1][3][i, qpos].tobytes() != got[-1][3][i, qpos].tobytes() for i in range(3))


def test_fork_gives_identical_continuations_under_equal_actions():
    """Slot 0's row copied into every slot: equal actions keep all slots byte-identical;
    one slot given other actions departs (the mutation)."""
    rng = np.random.default_rng(2)
    sim = make(4, seed=5)
    for _ in range(3):
        sim.run_ticks(noisy_expert(sim, rng, 2))
    sim.set_state([1, 2, 3], np.repeat(sim.get_state([0]), 3, axis=0))
    for _ in range(4):
        a = np.repeat(noisy_expert(sim, rng, 3)[:1], 4, axis=0)
        a[3] = np.clip(a[3] + 0.5, -1, 1)
        sim.run_ticks(a)
        rows = sim.get_state()
        assert all(rows[i].tobytes() == rows[0].tobytes() for i in (1, 2))
    assert rows[3].tobytes() != rows[0].tobytes()


def test_set_state_is_all_or_nothing_and_checks_its_input():
    sim = make(3)
    rows = sim.get_state()
    bad = rows.copy()
    fields = bad[:, 8 * sim.physics_size :].view(np.int64)
    fields[2, TASK_FIELDS.index("instruction")] = 99
    before = sim.get_state()
    with pytest.raises(ValueError, match="instruction"):
        sim.set_state(None, bad)
    assert np.array_equal(sim.get_state(), before)
    with pytest.raises(ValueError, match="uint8 of shape"):
        sim.set_state([0], rows)
    with pytest.raises(ValueError, match="distinct"):
        sim.set_state([0, 0], rows[:2])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        sim.get_state([3])
    with pytest.raises(ValueError, match="NaN"):
        sim.run_ticks(np.full((3, 1, 2), np.nan))


def test_render_draws_each_geom_in_the_tabletops_colours_where_the_physics_has_it():
    """Centre pixels take each object's colour, the end-effector's and the goals'; turning the
    square by 45 degrees moves its corners (the outline follows the body's heading)."""
    sim = make(2, seed=4)
    img = sim.render()
    assert img.shape == (2, 1, 64, 64, 3) and img.dtype == np.uint8
    img = img[:, 0]

    def pixel(xy: np.ndarray) -> tuple[int, int]:
        return int((1 - xy[1]) / 2 * 64), int((xy[0] + 1) / 2 * 64)

    obs = sim.observation()
    cfg = TabletopConfig()
    for s in range(2):
        for k, name in enumerate(cfg.objects):
            assert tuple(img[s][pixel(obs[s, 2 + 2 * k : 4 + 2 * k])]) == COLORS[name.split()[0]]
        assert tuple(img[s][pixel(obs[s, :2])]) == EE_COLOR
        assert tuple(img[s][pixel(np.array([0.72, 0.0]))]) in (GOAL_COLOR, *[COLORS[c] for c in COLORS])
    ee, obj, yaw = sim.poses()
    turned = sim.renderer(ee, obj, yaw + torch.tensor([np.pi / 4, 0, 0], dtype=yaw.dtype))[:, 0]
    assert not torch.equal(turned, torch.from_numpy(img))
    same_again = sim.renderer(ee, obj, yaw + torch.tensor([np.pi / 2, 0, 0], dtype=yaw.dtype))[:, 0]
    assert (same_again.numpy() != img).sum() <= 12  # a square turned by 90 degrees is itself (up to edge pixels)


def test_cameras_are_fixed_views_of_the_same_scene():
    """Three cameras (pi0's count): ``opposite`` is ``top`` turned by half a turn, pixel for pixel;
    ``centre`` at n pixels is the middle of ``top`` rendered at 2n (up to pixels on an edge). The
    one-camera scene's identity is unchanged, a multi-camera one names its views; an unknown view
    is refused by name. Mutations: the far view turned by a quarter instead, and the centre view
    at the whole table's scale, fail the same comparisons."""

    def sim_of(size: int, cameras: tuple[str, ...]) -> MujocoPush:
        sim = MujocoPush(3, PushConfig(TabletopConfig(image_size=size), cameras=cameras))
        sim.seed(np.arange(3) + 7)
        sim.reset()
        return sim

    sim = sim_of(32, ("top", "opposite", "centre"))
    wide = torch.from_numpy(sim_of(64, ("top",)).render())[:, 0, 16:48, 16:48]

    def views_agree(img: torch.Tensor) -> tuple[bool, bool]:
        return torch.equal(img[:, 1], img[:, 0].flip(1, 2)), bool((img[:, 2] != wide).any(-1).float().mean() < 0.01)

    img = torch.from_numpy(sim.render())
    assert img.shape == (3, 3, 32, 32, 3) and sim.num_cameras == 3
    assert views_agree(img) == (True, True)
    wrong = copy.copy(sim.renderer)
    wrong.views, wrong._consts = (VIEWS["top"], View(yaw=np.pi / 2), View()), {}
    assert views_agree(wrong(*sim.poses())) == (False, False)
    assert "cameras=top,opposite,centre" in sim.identity() and "cameras" not in make(1).identity()
    with pytest.raises(ValueError, match="cameras must name"):
        PushConfig(cameras=("wrist",))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_windowed_drawing_equals_the_whole_image_test_bit_for_bit(device):
    """Each shape drawn in its window around it gives the bytes of every shape tested at every
    pixel (:meth:`TopDownRenderer.reference`): the three views at 32 and 224 pixels, shapes
    anywhere on and off the table (windows pushed in at the edges), overlapping each other, and
    a world whose positions are not finite. Mutation: windows sized at the whole table's scale
    (the centre view's zoom forgotten) miss pixels of its shapes."""
    g = torch.Generator().manual_seed(3)
    for size, n in ((32, 256), (224, 8)):
        sim = MujocoPush(1, PushConfig(TabletopConfig(image_size=size), cameras=("top", "opposite", "centre")))
        r = sim.renderer
        k = len(r.footprints)
        ee = (torch.rand(n, 2, generator=g) * 2.6 - 1.3).to(device)
        obj = (torch.rand(n, k, 2, generator=g) * 2.6 - 1.3).to(device)
        yaw = (torch.rand(n, k, generator=g) * 7 - 3.5).to(device)
        ee[0], obj[1, 1], obj[2, 0, 0] = obj[0, 0], obj[1, 0] + 0.05, float("nan")  # overlaps; a diverged world
        want = r.reference(ee, obj, yaw)
        assert torch.equal(r(ee, obj, yaw), want)
        out = torch.empty_like(want)
        assert r(ee, obj, yaw, out=out) is out and torch.equal(out, want)
        short = copy.copy(r)  # windows sized at the whole table's scale: the centre view's zoom forgotten
        short.window = lambda reach, size=size: min(size, math.ceil(reach * size) + 3)
        assert not torch.equal(short(ee, obj, yaw), want)


def test_scripted_expert_succeeds_on_every_instruction_and_doing_nothing_does_not():
    """The expert on all twelve instructions (one seeded episode each, held-out ones
    included) within the env's default 40 chunks of 4 ticks (160); standing still (the mutation)
    fails them."""
    n = 12
    sim = MujocoPush(n, PushConfig(TabletopConfig(split="all")))
    sim.seed(np.arange(n) + 300)
    sim.reset(instruction=torch.arange(n))
    idle = MujocoPush(n, PushConfig(TabletopConfig(split="all")))
    idle.set_state(None, sim.get_state())
    for _ in range(160):
        sim.run_ticks(sim.expert()[:, None])
        if sim.success().all():
            break
    idle.run_ticks(np.zeros((n, 160, 2)))
    assert sim.success().sum() >= n - 1
    assert idle.success().sum() <= 2


def test_config_dataclass_roundtrip():
    cfg = PushConfig({"split": "heldout"})
    assert cfg.table.split == "heldout" and dataclasses.replace(cfg, frame_skip=5).frame_skip == 5
    with pytest.raises(ValueError, match="frame_skip"):
        PushConfig(frame_skip=0)
