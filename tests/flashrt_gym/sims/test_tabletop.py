import pytest
import torch

from flashrt.runtime import BufferSet, Graph
from flashrt_gym.sims.tabletop import COLORS, Tabletop, TabletopConfig


def make(n: int = 64, device: str = "cpu", seed: int = 0, **cfg) -> tuple[Tabletop, BufferSet]:
    task = Tabletop(TabletopConfig(**cfg))
    b = BufferSet(task.specs(), n, device)
    task.bind(b)
    task.seed(torch.arange(n, device=device) + 1000 * seed)
    task.reset()
    return task, b


def rollout(task: Tabletop, b: BufferSet, ticks: int, noise: float = 0.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.zeros(b.num_slots)
    sparse = torch.zeros(b.num_slots)
    for _ in range(ticks):
        a = task.expert() + noise * torch.randn(b.num_slots, 2, generator=g).to(b.device)
        d, s = task.step(a)
        dense += d.cpu()
        sparse += s.cpu()
    return dense, sparse


def test_contacts_keep_overlap_small_and_everything_in_bounds():
    task, b = make(256)
    cfg = task.cfg
    g = torch.Generator().manual_seed(1)
    for _ in range(60):
        task.step(torch.rand(256, 2, generator=g) * 2 - 1)
        obj, ee = b["sim.obj"], b["sim.ee"]
        assert obj.abs().max() <= 1 - cfg.obj_radius + 1e-6 and ee.abs().max() <= 1 - cfg.ee_radius + 1e-6
        pair = (obj[:, :, None] - obj[:, None, :]).norm(dim=-1) + torch.eye(3) * 10
        assert pair.min() > 2 * cfg.obj_radius - 0.02
        assert (obj - ee[:, None]).norm(dim=-1).min() > cfg.obj_radius + cfg.ee_radius - 0.02


def test_same_seed_same_rollout_other_seed_other_rollout():
    (t1, b1), (t2, b2), (t3, b3) = make(32, seed=3), make(32, seed=3), make(32, seed=4)
    for task, b in ((t1, b1), (t2, b2), (t3, b3)):
        rollout(task, b, 15, noise=0.5, seed=9)
    assert torch.equal(b1.slot_arena, b2.slot_arena)
    assert not torch.equal(b1["sim.obj"], b3["sim.obj"])


def test_run_ticks_writes_its_rewards_into_given_views_and_observation_matches_its_parts():
    """The chunk's summed rewards land in the given views of a wider buffer and equal the sum of
    one-tick steps; a wrong output is refused before any tick runs. The observation is end
    effector, objects and the instruction's target and goal one-hot."""
    (t1, b1), (t2, b2) = make(8, seed=5), make(8, seed=5)
    actions = torch.rand(8, 4, 2, generator=torch.Generator().manual_seed(2)) * 2 - 1
    want = [torch.zeros(8), torch.zeros(8)]
    for t in range(4):
        d, s = t1.step(actions[:, t])
        want[0] += d
        want[1] += s
    rewards = torch.full((8, 3), float("nan"))
    t2.run_ticks(actions, rewards[:, 0], rewards[:, 2])
    assert rewards[:, 1].isnan().all() and torch.equal(b1.slot_arena, b2.slot_arena)
    torch.testing.assert_close(rewards[:, 0], want[0])
    assert torch.equal(rewards[:, 2], want[1])
    before = b2.slot_arena.clone()
    with pytest.raises(ValueError, match=r"dense and sparse must be float32 \(8,\) tensors"):
        t2.run_ticks(actions, rewards[:4, 0], rewards[:4, 2])
    assert torch.equal(b2.slot_arena, before)
    target, goal = t1.target_and_goal()
    parts = [b1["sim.ee"], b1["sim.obj"].flatten(1), torch.eye(3)[target], torch.eye(len(t1.cfg.goals))[goal]]
    out = torch.empty(8, t1.observation_dim)
    t1.observation(out=out)
    assert torch.equal(out, torch.cat(parts, 1))


def test_render_shape_dtype_range_and_colours_where_objects_are():
    task, b = make(8, image_size=64)
    img = torch.zeros(8, 1, 64, 64, 3, dtype=torch.uint8)
    task.render(out=img)
    img = img[:, 0]
    assert img.shape == (8, 64, 64, 3) and img.dtype == torch.uint8
    assert img.min() >= 0 and img.max() <= 255 and img.float().std() > 10
    # the pixel under each object's centre has that object's colour
    for k, name in enumerate(task.cfg.objects):
        color = torch.tensor(COLORS[name.split()[0]], dtype=torch.float32)
        xy = b["sim.obj"][:, k]
        col = ((xy[:, 0] + 1) / 2 * 64).long().clamp(0, 63)
        row = ((1 - xy[:, 1]) / 2 * 64).long().clamp(0, 63)
        ee_far = (xy - b["sim.ee"]).norm(dim=-1) > task.cfg.ee_radius + 0.05
        got = img[torch.arange(8), row, col].float()
        assert torch.allclose(got[ee_far], color.expand_as(got)[ee_far])


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_noise_free_expert_succeeds_on_95_percent(split):
    task, b = make(256, split=split, seed=5)
    rollout(task, b, 150)
    assert b["sim.success"].float().mean() >= 0.95


def test_rewards_sparse_is_minus_one_until_success_dense_rewards_progress():
    task, b = make(64, seed=2)
    dense, sparse = rollout(task, b, 150)
    ticks = b["sim.tick"].float()
    assert b["sim.success"].all()
    assert torch.equal(sparse, -(ticks - 1))  # -1 on every tick but the successful one
    assert (dense > 0).all()
    # a frozen (succeeded) slot earns nothing and does not move
    before = b.slot_arena.clone()
    d, s = task.step(torch.ones(64, 2))
    assert torch.equal(before, b.slot_arena) and not d.any() and not s.any()


def test_masked_reset_touches_only_masked_slots_and_draws_from_the_split():
    task, b = make(64, seed=1)
    rollout(task, b, 10)
    before = b.slot_arena.clone()
    mask = torch.arange(64) % 3 == 0
    task.reset(mask)
    assert torch.equal(b.slot_arena[~mask], before[~mask])
    assert not torch.equal(b.slot_arena[mask], before[mask])
    assert (b["sim.tick"][mask] == 0).all()
    train = {task.instructions.index(task.cfg.instruction(o, g)) for o, g in task.cfg.combos("train")}
    assert set(b["sim.instruction"].tolist()) <= train
    _, held = make(64, split="heldout")
    assert not set(held["sim.instruction"].tolist()) & train


def test_instructions_and_vocabulary():
    cfg = TabletopConfig()
    assert cfg.instruction(0, 0) == "push the red square to the left goal"
    assert len(cfg.combos("train")) + len(cfg.combos("heldout")) == len(cfg.combos("all")) == 12
    assert {"push", "red", "square", "left", "goal"} <= set(cfg.vocabulary)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"objects": ()}, "at least one object"),
        ({"objects": ("pink square",)}, "colour in"),
        ({"objects": ("red blob",)}, "shape in"),
        ({"objects": ("red square", "red circle")}, "distinct colours"),
        ({"objects": ("red square", "blue square")}, "distinct shapes"),
        ({"goals": ("north",)}, "goals must be distinct names"),
        ({"split": "test"}, "split must be"),
        ({"image_size": 8}, "image_size must be >= 16"),
        ({"substeps": 0}, "substeps must be >= 1"),
        ({"friction": 1.0}, "friction must be in"),
    ],
)
def test_bad_task_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TabletopConfig(**kwargs)


def test_one_object_has_no_heldout_split():
    with pytest.raises(ValueError, match="holds no instructions out"):
        TabletopConfig(objects=("red square",), split="heldout").combos()


@pytest.mark.cuda
def test_cuda_simulator_agrees_with_cpu_and_captures_in_a_graph():
    task, cpu = make(128, "cpu", seed=7)
    gpu_task, gpu = make(128, "cuda", seed=7)
    assert torch.equal(cpu["sim.instruction"], gpu["sim.instruction"].cpu())
    torch.testing.assert_close(cpu["sim.obj"], gpu["sim.obj"].cpu(), atol=1e-5, rtol=0)
    for _ in range(20):
        task.step(task.expert())
        gpu_task.step(gpu_task.expert())
    torch.testing.assert_close(cpu["sim.obj"], gpu["sim.obj"].cpu(), atol=1e-3, rtol=0)
    # one captured graph: expert + chunk of ticks + masked reset of succeeded slots + render
    eager_task, eager = make(128, "cuda", seed=8)
    graph_task, graph = make(128, "cuda", seed=8)
    frames = {id(eager): torch.zeros(128, 1, 64, 64, 3, dtype=torch.uint8, device="cuda")}
    frames[id(graph)] = torch.zeros_like(frames[id(eager)])
    rewards = torch.zeros(2, 128, device="cuda")

    def tick(t, b):
        t.run_ticks(t.expert()[:, None].expand(-1, 2, -1), rewards[0], rewards[1])
        t.reset(t.success.clone())
        t.render(out=frames[id(b)])

    g = Graph("sim").bind(graph)
    g.capture(128, lambda: tick(graph_task, graph))
    for _ in range(40):
        tick(eager_task, eager)
        g.replay(128)
        assert torch.equal(eager.slot_arena, graph.slot_arena)
    assert torch.equal(frames[id(eager)], frames[id(graph)])
