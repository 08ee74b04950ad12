"""A batched, pure-torch, top-down tabletop: push the named object to the named goal.

Every slot is one table in ``[-1, 1]^2`` (x right, y up): an end-effector disk under velocity
control, ``K`` objects of distinct colours and shapes, and four goal regions (left, right, top,
bottom) that look alike, so only the instruction ("push the red square to the left goal")
says which object and which goal count. All state lives in ``sim.*`` slot buffers of the env's
:class:`flashrt.runtime.BufferSet` (:class:`TabletopState`); ``reset`` / ``run_ticks`` /
``render`` are fixed-shape tensor programs with fixed iteration counts and no host
synchronisation, so they run on the CPU and inside a captured CUDA graph alike: the tabletop is
an in-graph :class:`flashrt_gym.simulator.Simulator`.

Physics per tick: ``substeps`` moves of the end-effector, each followed by ``contact_iters``
rounds of position projection (end-effector pushes objects, objects push each other, walls
clamp). Contacts use circles of the objects' radius whatever their drawn shape. Objects keep
``friction`` of their last displacement as velocity into the next substep (sliding that dies
out), so a push carries a little.

Rewards per tick: ``dense`` = progress of the target object towards its goal (+ a smaller
progress of the end-effector towards the object, + a bonus on success); ``sparse`` = -1 until
success, then 0 (DSRL's convention). A slot that has succeeded is frozen and earns 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flashrt.kernels import use_triton
from flashrt.kernels.rng import uniform
from flashrt.runtime import BufferSet, BufferSpec, slot
from flashrt.runtime.views import bind_views
from flashrt_gym.sims.tabletop.config import (
    BACKGROUND,
    COLORS,
    EE_COLOR,
    GOAL_COLOR,
    GOALS,
    SHAPES,
    TabletopConfig,
)
from flashrt_gym.sims.tabletop.triton_kernels import Scene, render_triton, reset_triton, ticks_triton
from flashrt_gym.simulator import BoundState


@dataclass(frozen=True)
class TabletopState:
    """Typed views of the tabletop's ``sim.*`` slot buffers (each ``(slots, ...)``)."""

    ee: torch.Tensor  # (2,) end-effector position
    obj: torch.Tensor  # (K, 2) object positions
    obj_vel: torch.Tensor  # (K, 2) carried-over displacement per substep
    instruction: torch.Tensor  # () int64 index into Tabletop.instructions
    tick: torch.Tensor  # () int64 ticks into the episode (frozen after success)
    success: torch.Tensor  # () bool
    key: torch.Tensor  # () int64 the slot's RNG stream
    counter: torch.Tensor  # () int64 draws taken from it (one per episode)


class Tabletop(BoundState):
    """The batched tabletop simulator, bound to the ``sim.*`` buffers of one buffer set.

    Make it, put :meth:`specs` into the set's specs, then :meth:`bind` it to the set.

    Args:
        cfg: the task's parameters.
    """

    num_cameras = 1
    action_dim = 2
    proprio_dim = 2
    observation_bound = 1.0

    def __init__(self, cfg: TabletopConfig | None = None) -> None:
        self.cfg = cfg = cfg or TabletopConfig()
        self.num_objects = len(cfg.objects)
        self.instructions = [cfg.instruction(o, g) for o, g in cfg.combos("all")]
        self.image_size = cfg.image_size
        self.scene = Scene(
            cfg.ee_radius, cfg.obj_radius, cfg.goal_radius, cfg.max_speed, cfg.friction, cfg.substeps,
            cfg.contact_iters, BACKGROUND, GOAL_COLOR, EE_COLOR,
        )  # fmt: skip
        self._combos_all = cfg.combos("all")
        self._split = [self._combos_all.index(c) for c in cfg.combos()]
        self._state: TabletopState | None = None
        self.tables: dict[str, torch.Tensor] = {}  # constant lookup tables on the bound device

    # -- layout --------------------------------------------------------------------------------
    def specs(self) -> list[BufferSpec]:
        """The per-slot state buffers the simulator reads and writes."""
        k = self.num_objects
        return [
            slot("sim.ee", (2,)),
            slot("sim.obj", (k, 2)),
            slot("sim.obj_vel", (k, 2)),
            slot("sim.instruction", (), torch.int64),
            slot("sim.tick", (), torch.int64),
            slot("sim.success", (), torch.bool),
            slot("sim.key", (), torch.int64),
            slot("sim.counter", (), torch.int64),
        ]

    def bind(self, bufs: BufferSet) -> Tabletop:
        """Take the ``sim.*`` buffers of ``bufs`` (once) and build the constant tables on its device."""
        if self._state is not None:
            raise ValueError("this Tabletop is bound to a buffer set already; make one Tabletop per set")
        self._state = bind_views(TabletopState, bufs, "sim")
        cfg, device = self.cfg, bufs.device
        n = cfg.image_size
        lin = (torch.arange(n, dtype=torch.float32) + 0.5) / n * 2 - 1
        ys, xs = torch.meshgrid(-lin, lin, indexing="ij")  # row 0 is the top of the table
        targets, goals = [o for o, _ in self._combos_all], [g for _, g in self._combos_all]
        self.tables = {
            "combos": torch.tensor(self._combos_all, dtype=torch.int64, device=device),
            # per instruction: the target's one-hot over objects, then the goal's over goals
            "onehots": torch.cat([torch.eye(self.num_objects)[targets], torch.eye(len(cfg.goals))[goals]], 1).to(
                device
            ),
            "split": torch.tensor(self._split, dtype=torch.int64, device=device),
            "goals": torch.tensor([GOALS[g] for g in cfg.goals], dtype=torch.float32, device=device),
            "pix": torch.stack([xs, ys], -1).to(device),  # (H, W, 2)
            "colors": torch.tensor([COLORS[o.split()[0]] for o in cfg.objects], dtype=torch.float32, device=device),
            "shapes": torch.tensor([SHAPES.index(o.split()[1]) for o in cfg.objects], dtype=torch.int32, device=device),
            "background": torch.tensor(BACKGROUND, dtype=torch.float32, device=device),
            "goal_color": torch.tensor(GOAL_COLOR, dtype=torch.float32, device=device),
            "ee_color": torch.tensor(EE_COLOR, dtype=torch.float32, device=device),
        }
        return self

    @property
    def observation_dim(self) -> int:
        """Length of :meth:`observation`: ee (2), objects (2K), target one-hot (K), goal one-hot (G)."""
        return 2 + 3 * self.num_objects + len(self.cfg.goals)

    def identity(self) -> str:
        """What makes two tabletops' states interchangeable (for the deployment digest)."""
        return f"tabletop|{sorted(self.cfg.to_dict().items())}"

    def target_and_goal(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots,) target object index and (slots,) goal index of each slot's instruction."""
        combo = self.tables["combos"][self.state.instruction]
        return combo[:, 0], combo[:, 1]

    def validate(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` naming the buffer if ``sim.*`` tensors (e.g. a capsule's, before
        it is restored) hold values this simulator cannot step from."""
        instr = state["sim.instruction"]
        if instr.numel() and (int(instr.min()) < 0 or int(instr.max()) >= len(self.instructions)):
            raise ValueError(f"sim.instruction holds indices outside [0, {len(self.instructions)})")
        for name in ("sim.tick", "sim.counter"):
            if state[name].numel() and int(state[name].min()) < 0:
                raise ValueError(f"{name} holds negative values")
        for name in ("sim.ee", "sim.obj", "sim.obj_vel"):
            if not torch.isfinite(state[name]).all():
                raise ValueError(f"{name} holds NaN or infinity")
        success = state["sim.success"]
        if success.numel() and int(success.view(torch.uint8).max()) > 1:
            raise ValueError("sim.success holds bytes other than 0 and 1")

    # -- dynamics ------------------------------------------------------------------------------
    def seed(self, seeds: torch.Tensor) -> None:
        """Give every slot the RNG stream of its int64 seed (slots,), from its first draw."""
        s = self.state
        s.key.copy_(seeds)
        s.counter.zero_()

    def reset(self, mask: torch.Tensor | None = None, instruction: torch.Tensor | None = None) -> None:
        """Draw the next episode of each slot's RNG stream where ``mask`` (all slots if None).

        ``instruction`` (slots,) int64 forces instruction indices (``-1`` keeps the draw). One
        Triton launch on CUDA (:mod:`flashrt_gym.sims.tabletop.triton_kernels`), torch elsewhere.
        """
        cfg, c, k, s = self.cfg, self.tables, self.num_objects, self.state
        if use_triton(s.ee, *(t for t in (mask, instruction) if t is not None)):
            reset_triton(s, c, self.scene, cfg.spawn, mask, instruction)
            return
        m = torch.ones_like(s.success) if mask is None else mask
        u = uniform(s.key, s.counter, 3 + 2 * k)
        split = c["split"]
        drawn = split[(u[:, 0] * len(self._split)).long().clamp_(max=len(self._split) - 1)]
        if instruction is not None:
            drawn = torch.where(instruction >= 0, instruction, drawn)
        ee = (u[:, 1:3] * 2 - 1) * cfg.spawn
        obj = ((u[:, 3:] * 2 - 1) * cfg.spawn).view(-1, k, 2)
        for _ in range(8):  # separate overlapping starts
            obj = self._contacts(ee, obj)
        w = m.view(-1, 1)
        s.ee.copy_(torch.where(w, ee, s.ee))
        s.obj.copy_(torch.where(w[:, :, None], obj, s.obj))
        s.obj_vel.masked_fill_(w[:, :, None], 0.0)
        s.instruction.copy_(torch.where(m, drawn, s.instruction))
        s.tick.masked_fill_(m, 0)
        s.success.masked_fill_(m, False)
        s.counter.add_(m.long())

    def _contacts(self, ee: torch.Tensor, obj: torch.Tensor) -> torch.Tensor:
        """One round of position projection: ee pushes objects, objects push apart, walls."""
        cfg = self.cfg
        d = obj - ee[:, None]
        dist = d.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        obj = obj + d / dist * (cfg.ee_radius + cfg.obj_radius - dist).clamp_min(0.0)
        if self.num_objects > 1:
            dij = obj[:, :, None] - obj[:, None, :]  # (N, K, K, 2)
            dist = dij.norm(dim=-1, keepdim=True)
            overlap = (2 * cfg.obj_radius - dist).clamp_min(0.0) * (dist > 1e-6)
            obj = obj + 0.5 * (dij / dist.clamp_min(1e-6) * overlap).sum(dim=2)
        lim = 1.0 - cfg.obj_radius
        return obj.clamp(-lim, lim)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance every slot one tick under ``action`` (slots, 2) in [-1, 1] (clipped): the
        torch reference of one tick of :meth:`run_ticks`.

        Returns:
            (dense, sparse) rewards of this tick, each (slots,) float32.
        """
        cfg, s = self.cfg, self.state
        alive = ~s.success
        d_obj0, d_ee0 = self._distances()
        vel = action.clamp(-1.0, 1.0) * (cfg.max_speed / cfg.substeps) * alive[:, None]
        ee, obj, obj_vel = s.ee, s.obj, s.obj_vel
        lim = 1.0 - cfg.ee_radius
        for _ in range(cfg.substeps):
            new_ee = (ee + vel).clamp(-lim, lim)
            prev = obj
            moved = obj + obj_vel
            for _ in range(cfg.contact_iters):
                moved = self._contacts(new_ee, moved)
            a = alive.view(-1, 1, 1)
            obj_vel = torch.where(a, (moved - prev) * cfg.friction, obj_vel)
            obj = torch.where(a, moved, obj)
            ee = new_ee
        s.ee.copy_(ee)
        s.obj.copy_(obj)
        s.obj_vel.copy_(obj_vel)
        d_obj1, d_ee1 = self._distances()
        success = d_obj1 < cfg.goal_radius
        newly = success & alive
        s.success.copy_(success | ~alive)
        s.tick.add_(alive.long())
        dense = (5.0 * (d_obj0 - d_obj1) + 1.0 * (d_ee0 - d_ee1) + 2.0 * newly) * alive
        sparse = torch.where(alive & ~success, -1.0, 0.0)
        return dense, sparse

    def run_ticks(self, actions: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """Advance every slot ``T`` ticks under ``actions (slots, T, 2)`` and write the summed
        (dense, sparse) rewards into ``dense`` and ``sparse`` (float32 (slots,), any stride).
        One Triton launch on CUDA (:mod:`flashrt_gym.sims.tabletop.triton_kernels`), :meth:`step` per
        tick elsewhere."""
        s = self.state
        n = s.ee.shape[0]
        if any(o.shape != (n,) or o.dtype != torch.float32 for o in (dense, sparse)):
            raise ValueError(f"run_ticks: dense and sparse must be float32 ({n},) tensors")
        if use_triton(s.ee, actions, dense, sparse):
            ticks_triton(s, self.tables, self.scene, actions, dense, sparse)
            return
        dense.zero_()
        sparse.zero_()
        for t in range(actions.shape[1]):
            d, sp = self.step(actions[:, t])
            dense.add_(d)
            sparse.add_(sp)

    def _distances(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Target object to its goal centre, and end-effector to the target's contact ring."""
        s = self.state
        target, goal = self.target_and_goal()
        obj = s.obj.gather(1, target.view(-1, 1, 1).expand(-1, 1, 2)).squeeze(1)
        g = self.tables["goals"][goal]
        ring = (s.ee - obj).norm(dim=-1) - (self.cfg.ee_radius + self.cfg.obj_radius)
        return (obj - g).norm(dim=-1), ring.clamp_min(0.0)

    # -- observations --------------------------------------------------------------------------
    def render(self, out: torch.Tensor) -> None:
        """Write every slot's top-down image into ``out (slots, 1, H, W, 3)`` uint8 (one Triton
        launch on CUDA, :mod:`flashrt_gym.sims.tabletop.triton_kernels`)."""
        size, n = self.cfg.image_size, self.state.ee.shape[0]
        if out.shape != (n, 1, size, size, 3) or out.dtype != torch.uint8:
            raise ValueError(
                f"render: out must be ({n}, 1, {size}, {size}, 3) uint8, got {tuple(out.shape)} {out.dtype}"
            )
        if use_triton(out, self.state.ee):
            render_triton(self.state, self.tables, self.scene, out[:, 0])
        else:
            out[:, 0].copy_(self.render_reference())

    def render_reference(self) -> torch.Tensor:
        """(slots, H, W, 3) uint8: the torch reference of the render."""
        cfg, c, s = self.cfg, self.tables, self.state
        pix = c["pix"]  # (H, W, 2)
        n = s.ee.shape[0]
        img = c["background"].expand(n, *pix.shape[:2], 3)
        goal_mask = ((pix[None] - c["goals"][:, None, None]).norm(dim=-1) < cfg.goal_radius).any(0)
        img = torch.where(goal_mask[None, :, :, None], c["goal_color"], img)
        r = cfg.obj_radius
        for k, shape in enumerate(SHAPES.index(o.split()[1]) for o in cfg.objects):
            d = pix[None] - s.obj[:, k][:, None, None]  # (N, H, W, 2)
            dx, dy = d[..., 0], d[..., 1]
            if shape == 0:  # square
                inside = torch.maximum(dx.abs(), dy.abs()) < 0.85 * r
            elif shape == 1:  # circle
                inside = dx * dx + dy * dy < r * r
            elif shape == 2:  # triangle, apex up
                inside = (dy > -0.75 * r) & (dy + 1.7 * dx.abs() < 0.95 * r)
            else:  # diamond
                inside = dx.abs() + dy.abs() < 1.05 * r
            img = torch.where(inside[..., None], c["colors"][k], img)
        d = pix[None] - s.ee[:, None, None]
        img = torch.where((d.norm(dim=-1) < cfg.ee_radius)[..., None], c["ee_color"], img)
        return img.to(torch.uint8)

    def proprio(self, out: torch.Tensor) -> None:
        """(slots, 2) end-effector position, the policy's proprioceptive input, into ``out``."""
        out.copy_(self.state.ee)

    def observation(self, out: torch.Tensor) -> None:
        """(slots, observation_dim) float32 low-dimensional observation into ``out``: end effector,
        objects, and the instruction's target and goal one-hot (looked up per instruction)."""
        s = self.state
        onehots = self.tables["onehots"][s.instruction]
        torch.cat([s.ee, s.obj.reshape(s.ee.shape[0], -1), onehots], dim=1, out=out)

    # -- scripted expert -----------------------------------------------------------------------
    def expert(self) -> torch.Tensor:
        """(slots, 2) action of a scripted pusher: get behind the target (going around it when
        in front), then push it along the line to the goal centre, correcting sideways."""
        cfg, s = self.cfg, self.state
        target, goal = self.target_and_goal()
        ee = s.ee
        obj = s.obj.gather(1, target.view(-1, 1, 1).expand(-1, 1, 2)).squeeze(1)
        g = self.tables["goals"][goal]
        to_goal = g - obj
        u = to_goal / to_goal.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        perp = torch.stack([-u[:, 1], u[:, 0]], dim=-1)
        contact = cfg.ee_radius + cfg.obj_radius
        rel = ee - obj
        along = (rel * u).sum(-1)  # < 0: behind the object
        side = (rel * perp).sum(-1)
        push_point = obj - u * (contact + 0.01)
        behind = (along < -0.6 * contact) & (side.abs() < 0.5 * contact)
        # pushing: drive along u, pull the end-effector back onto the line through the object
        push = u + 4.0 * (push_point - ee - u * ((push_point - ee) * u).sum(-1, keepdim=True))
        # approaching: go to a point behind the object; from in front, first to its side
        sign = torch.where(side >= 0, 1.0, -1.0)[:, None]
        around = obj + perp * sign * (contact + 0.06) - u * 0.5 * contact
        waypoint = torch.where((along > -0.3 * contact)[:, None], around, push_point - u * 0.02)
        approach = (waypoint - ee) / cfg.max_speed
        action = torch.where(behind[:, None], push, approach)
        return action.clamp(-1.0, 1.0)
