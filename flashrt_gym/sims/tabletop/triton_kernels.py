"""The tabletop's hot path as Triton kernels: all ticks of an action chunk, the render, and the
masked reset (an autoreset inside the step draws the next episodes of the finished slots).

:meth:`Tabletop.step <flashrt_gym.sims.tabletop.Tabletop.step>` (one tick) and
:meth:`Tabletop.render_reference <flashrt_gym.sims.tabletop.Tabletop.render_reference>` in torch are the
references: a tick is about 150 small kernels (substeps x contact rounds of elementwise work on
``(N, K, 2)`` tensors) and the render about 40, all launch-bound. Here one program owns a block
of slots and runs every tick of the chunk with the state in registers (one launch per chunk),
one program renders a block of pixels of one slot straight into the policy's image buffer, and
one launch draws and separates every masked slot's next episode (about 150 kernels in torch).
The arithmetic follows the references operation by operation; results agree to float32 rounding.

The kernels take the state as the tensors they read and write, with every stride (slot buffers
are views of a slot-major arena whose slot stride is the row), plus the scene's constants
(:class:`Scene`) and tables: they know nothing of the task object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from flashrt.kernels.backend import sm_count, tl, triton
from flashrt.kernels.rng import uniform_tl


@dataclass(frozen=True)
class Scene:
    """The constants the kernels compile in: sizes and speeds in table units, iteration counts,
    and the RGB colours of the background, the goals and the end-effector."""

    ee_radius: float
    obj_radius: float
    goal_radius: float
    max_speed: float
    friction: float
    substeps: int
    contact_iters: int
    background: tuple[int, int, int]
    goal_color: tuple[int, int, int]
    ee_color: tuple[int, int, int]


class State(Protocol):
    """The slot buffers the kernels take (``flashrt_gym.sims.tabletop.tabletop.TabletopState``)."""

    ee: torch.Tensor
    obj: torch.Tensor
    obj_vel: torch.Tensor
    instruction: torch.Tensor
    tick: torch.Tensor
    success: torch.Tensor


class ResetState(State, Protocol):
    """What the reset also reads and writes: each slot's RNG stream."""

    key: torch.Tensor
    counter: torch.Tensor


if triton is not None:

    @triton.jit
    def _norm(x, y):
        return tl.sqrt(x * x + y * y)

    @triton.jit
    def _contacts(ex, ey, ox, oy, valid, EE_R: tl.constexpr, OBJ_R: tl.constexpr, K: tl.constexpr):
        """One round of position projection; ex, ey (B,), ox, oy (B, KP)."""
        dx = ox - ex[:, None]
        dy = oy - ey[:, None]
        dist = tl.maximum(_norm(dx, dy), 1e-6)
        push = tl.maximum(EE_R + OBJ_R - dist, 0.0)
        ox = ox + dx / dist * push
        oy = oy + dy / dist * push
        if K > 1:
            dxij = ox[:, :, None] - ox[:, None, :]  # (B, KP, KP)
            dyij = oy[:, :, None] - oy[:, None, :]
            d = _norm(dxij, dyij)
            overlap = tl.where(d > 1e-6, tl.maximum(2 * OBJ_R - d, 0.0), 0.0)
            overlap = tl.where(valid[None, None, :], overlap, 0.0)
            dc = tl.maximum(d, 1e-6)
            ox = ox + 0.5 * tl.sum(dxij / dc * overlap, axis=2)
            oy = oy + 0.5 * tl.sum(dyij / dc * overlap, axis=2)
        lim = 1.0 - OBJ_R
        return tl.minimum(tl.maximum(ox, -lim), lim), tl.minimum(tl.maximum(oy, -lim), lim)

    @triton.jit
    def _target_distances(ex, ey, ox, oy, target, gx, gy, kk, EE_R: tl.constexpr, OBJ_R: tl.constexpr):
        tx = tl.sum(tl.where(kk[None, :] == target[:, None], ox, 0.0), axis=1)
        ty = tl.sum(tl.where(kk[None, :] == target[:, None], oy, 0.0), axis=1)
        ring = _norm(ex - tx, ey - ty) - (EE_R + OBJ_R)
        return _norm(tx - gx, ty - gy), tl.maximum(ring, 0.0)

    @triton.jit
    def _ticks_kernel(
        ee, obj, vel, success, tick, instruction, actions, combos, goals, dense_out, sparse_out,
        n, s_ee, s_ee1, s_obj, s_objk, s_obj1, s_vel, s_velk, s_vel1, s_succ, s_tick, s_inst,
        s_an, s_at, s_aa, s_dense, s_sparse, T,
        K: tl.constexpr, KP: tl.constexpr, SUBSTEPS: tl.constexpr, ITERS: tl.constexpr,
        EE_R: tl.constexpr, OBJ_R: tl.constexpr, GOAL_R: tl.constexpr, SPEED: tl.constexpr,
        FRICTION: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = rows < n
        r = rows.to(tl.int64)
        kk = tl.arange(0, KP)
        valid = kk < K
        m2 = live[:, None] & valid[None, :]
        ex = tl.load(ee + r * s_ee, mask=live, other=0.0)
        ey = tl.load(ee + r * s_ee + s_ee1, mask=live, other=0.0)
        ptr_o = obj + r[:, None] * s_obj + kk[None, :] * s_objk
        ptr_v = vel + r[:, None] * s_vel + kk[None, :] * s_velk
        far = 100.0 + 10.0 * kk[None, :].to(tl.float32)  # padding objects sit far apart, never touch
        ox = tl.load(ptr_o, mask=m2, other=0.0) + tl.where(valid[None, :], 0.0, far)
        oy = tl.load(ptr_o + s_obj1, mask=m2, other=0.0)
        vx = tl.load(ptr_v, mask=m2, other=0.0)
        vy = tl.load(ptr_v + s_vel1, mask=m2, other=0.0)
        done = tl.load(success + r * s_succ, mask=live, other=1) != 0
        ticks = tl.load(tick + r * s_tick, mask=live, other=0)
        inst = tl.load(instruction + r * s_inst, mask=live, other=0)
        target = tl.load(combos + inst * 2, mask=live, other=0)
        goal = tl.load(combos + inst * 2 + 1, mask=live, other=0)
        gx = tl.load(goals + goal * 2, mask=live, other=0.0)
        gy = tl.load(goals + goal * 2 + 1, mask=live, other=0.0)
        dense = tl.zeros((BLOCK,), dtype=tl.float32)
        sparse = tl.zeros((BLOCK,), dtype=tl.float32)
        lim_ee = 1.0 - EE_R
        for t in range(T):
            alive = ~done
            af = alive.to(tl.float32)
            d_obj0, d_ee0 = _target_distances(ex, ey, ox, oy, target, gx, gy, kk, EE_R, OBJ_R)
            ax = tl.load(actions + r * s_an + t * s_at, mask=live, other=0.0)
            ay = tl.load(actions + r * s_an + t * s_at + s_aa, mask=live, other=0.0)
            velx = tl.minimum(tl.maximum(ax, -1.0), 1.0) * (SPEED / SUBSTEPS) * af
            vely = tl.minimum(tl.maximum(ay, -1.0), 1.0) * (SPEED / SUBSTEPS) * af
            for _ in tl.static_range(SUBSTEPS):
                ex = tl.minimum(tl.maximum(ex + velx, -lim_ee), lim_ee)
                ey = tl.minimum(tl.maximum(ey + vely, -lim_ee), lim_ee)
                mx = ox + vx
                my = oy + vy
                for _ in tl.static_range(ITERS):
                    mx, my = _contacts(ex, ey, mx, my, valid, EE_R, OBJ_R, K)
                a2 = alive[:, None] & valid[None, :]
                vx = tl.where(a2, (mx - ox) * FRICTION, vx)
                vy = tl.where(a2, (my - oy) * FRICTION, vy)
                ox = tl.where(a2, mx, ox)
                oy = tl.where(a2, my, oy)
            d_obj1, d_ee1 = _target_distances(ex, ey, ox, oy, target, gx, gy, kk, EE_R, OBJ_R)
            hit = d_obj1 < GOAL_R
            newly = (hit & alive).to(tl.float32)
            dense += (5.0 * (d_obj0 - d_obj1) + 1.0 * (d_ee0 - d_ee1) + 2.0 * newly) * af
            sparse += tl.where(alive & ~hit, -1.0, 0.0)
            ticks += alive.to(tl.int64)
            done = hit | done
        tl.store(ee + r * s_ee, ex, mask=live)
        tl.store(ee + r * s_ee + s_ee1, ey, mask=live)
        tl.store(ptr_o, ox, mask=m2)
        tl.store(ptr_o + s_obj1, oy, mask=m2)
        tl.store(ptr_v, vx, mask=m2)
        tl.store(ptr_v + s_vel1, vy, mask=m2)
        tl.store(success + r * s_succ, done.to(tl.int8), mask=live)
        tl.store(tick + r * s_tick, ticks, mask=live)
        tl.store(dense_out + r * s_dense, dense, mask=live)
        tl.store(sparse_out + r * s_sparse, sparse, mask=live)

    @triton.jit
    def _reset_kernel(
        ee, obj, vel, success, tick, instruction, key, counter, mask, force, split,
        n, n_split, s_ee, s_ee1, s_obj, s_objk, s_obj1, s_vel, s_velk, s_vel1, s_succ, s_tick, s_inst,
        s_key, s_cnt, s_mask, s_force,
        HAS_MASK: tl.constexpr, HAS_FORCE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
        EE_R: tl.constexpr, OBJ_R: tl.constexpr, SPAWN: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = rows < n
        r = rows.to(tl.int64)
        if HAS_MASK:
            live = live & (tl.load(mask + r * s_mask, mask=live, other=0) != 0)
        k = tl.load(key + r * s_key, mask=live, other=0)
        c = tl.load(counter + r * s_cnt, mask=live, other=0)
        pick = tl.minimum((uniform_tl(k, c, 0) * n_split).to(tl.int64), n_split - 1)
        drawn = tl.load(split + pick, mask=live, other=0)
        if HAS_FORCE:
            forced = tl.load(force + r * s_force, mask=live, other=-1)
            drawn = tl.where(forced >= 0, forced, drawn)
        ex = (uniform_tl(k, c, 1) * 2 - 1) * SPAWN
        ey = (uniform_tl(k, c, 2) * 2 - 1) * SPAWN
        kk = tl.arange(0, KP).to(tl.int64)
        valid = kk < K
        far = 100.0 + 10.0 * kk[None, :].to(tl.float32)  # padding objects sit far apart, never touch
        ox = (uniform_tl(k[:, None], c[:, None], 3 + 2 * kk[None, :]) * 2 - 1) * SPAWN
        ox = ox + tl.where(valid[None, :], 0.0, far)
        oy = (uniform_tl(k[:, None], c[:, None], 4 + 2 * kk[None, :]) * 2 - 1) * SPAWN
        for _ in tl.static_range(8):  # separate overlapping starts
            ox, oy = _contacts(ex, ey, ox, oy, valid, EE_R, OBJ_R, K)
        m2 = live[:, None] & valid[None, :]
        tl.store(ee + r * s_ee, ex, mask=live)
        tl.store(ee + r * s_ee + s_ee1, ey, mask=live)
        ptr_o = obj + r[:, None] * s_obj + kk[None, :] * s_objk
        ptr_v = vel + r[:, None] * s_vel + kk[None, :] * s_velk
        tl.store(ptr_o, ox, mask=m2)
        tl.store(ptr_o + s_obj1, oy, mask=m2)
        tl.store(ptr_v, tl.zeros_like(ox), mask=m2)
        tl.store(ptr_v + s_vel1, tl.zeros_like(oy), mask=m2)
        tl.store(instruction + r * s_inst, drawn, mask=live)
        tl.store(tick + r * s_tick, tl.zeros_like(drawn), mask=live)
        tl.store(success + r * s_succ, tl.zeros_like(drawn).to(tl.int8), mask=live)
        tl.store(counter + r * s_cnt, c + 1, mask=live)

    @triton.jit
    def _render_kernel(
        out, ee, obj, goals, colors, shapes, s_out, s_oh, s_ow, s_oc, s_ee, s_ee1, s_obj, s_objk, s_obj1,
        n_goals, n_objects,
        SIZE: tl.constexpr, EE_R: tl.constexpr, OBJ_R: tl.constexpr, GOAL_R: tl.constexpr,
        BG_R: tl.constexpr, BG_G: tl.constexpr, BG_B: tl.constexpr,
        GOAL_CR: tl.constexpr, GOAL_CG: tl.constexpr, GOAL_CB: tl.constexpr,
        EE_CR: tl.constexpr, EE_CG: tl.constexpr, EE_CB: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside_img = p < SIZE * SIZE
        row = p // SIZE
        col = p % SIZE
        px = (col.to(tl.float32) + 0.5) / SIZE * 2 - 1
        py = -((row.to(tl.float32) + 0.5) / SIZE * 2 - 1)
        cr = tl.full((BLOCK,), BG_R, tl.float32)
        cg = tl.full((BLOCK,), BG_G, tl.float32)
        cb = tl.full((BLOCK,), BG_B, tl.float32)
        on_goal = px > 10.0  # all False
        for g in range(n_goals):
            on_goal = on_goal | (_norm(px - tl.load(goals + 2 * g), py - tl.load(goals + 2 * g + 1)) < GOAL_R)
        cr = tl.where(on_goal, GOAL_CR, cr)
        cg = tl.where(on_goal, GOAL_CG, cg)
        cb = tl.where(on_goal, GOAL_CB, cb)
        for k in range(n_objects):
            dx = px - tl.load(obj + s * s_obj + k * s_objk)
            dy = py - tl.load(obj + s * s_obj + k * s_objk + s_obj1)
            shape = tl.load(shapes + k)
            ax = tl.abs(dx)
            ay = tl.abs(dy)
            square = tl.maximum(ax, ay) < 0.85 * OBJ_R
            circle = dx * dx + dy * dy < OBJ_R * OBJ_R
            triangle = (dy > -0.75 * OBJ_R) & (dy + 1.7 * ax < 0.95 * OBJ_R)
            diamond = ax + ay < 1.05 * OBJ_R
            hit = tl.where(shape == 0, square, tl.where(shape == 1, circle, tl.where(shape == 2, triangle, diamond)))
            cr = tl.where(hit, tl.load(colors + 3 * k), cr)
            cg = tl.where(hit, tl.load(colors + 3 * k + 1), cg)
            cb = tl.where(hit, tl.load(colors + 3 * k + 2), cb)
        on_ee = _norm(px - tl.load(ee + s * s_ee), py - tl.load(ee + s * s_ee + s_ee1)) < EE_R
        cr = tl.where(on_ee, EE_CR, cr)
        cg = tl.where(on_ee, EE_CG, cg)
        cb = tl.where(on_ee, EE_CB, cb)
        dst = out + s * s_out + row.to(tl.int64) * s_oh + col.to(tl.int64) * s_ow
        tl.store(dst, cr.to(tl.uint8), mask=inside_img)
        tl.store(dst + s_oc, cg.to(tl.uint8), mask=inside_img)
        tl.store(dst + 2 * s_oc, cb.to(tl.uint8), mask=inside_img)


_RENDER_BLOCK = 1024


def _ticks_launch(n: int, device: torch.device) -> tuple[int, int]:
    """(slots a program, warps) of the ticks kernel. A program's contact rounds are a serial
    chain of small reductions: with up to one program per SM, two slots in one warp (no
    cross-warp reductions); beyond that, blocks of 16 in four warps (measurements in
    docs/PERFORMANCE.md). Every shape gives the same bytes."""
    return (2, 1) if triton.cdiv(n, 2) <= sm_count(device) else (16, 4)


def ticks_triton(
    state: State,
    tables: Mapping[str, torch.Tensor],
    scene: Scene,
    actions: torch.Tensor,
    dense: torch.Tensor,
    sparse: torch.Tensor,
) -> None:
    """Every tick of ``actions (slots, T, 2)`` in one launch, the state updated in place and the
    summed rewards written into ``dense`` and ``sparse`` (float32 ``(slots,)``). Every tensor may
    have any strides. ``tables``: ``combos`` (instructions, 2) int64 and ``goals`` (G, 2) float32,
    contiguous."""
    n = state.ee.shape[0]
    if n == 0:
        return
    ee, obj, vel, inst, tick = state.ee, state.obj, state.obj_vel, state.instruction, state.tick
    success = state.success.view(torch.int8)
    k = obj.shape[1]
    block, warps = _ticks_launch(n, ee.device)
    _ticks_kernel[(triton.cdiv(n, block),)](
        ee, obj, vel, success, tick, inst, actions, tables["combos"], tables["goals"], dense, sparse,
        n, *ee.stride(), *obj.stride(), *vel.stride(), success.stride(0), tick.stride(0), inst.stride(0),
        *actions.stride(), dense.stride(0), sparse.stride(0), actions.shape[1],
        K=k, KP=triton.next_power_of_2(k), SUBSTEPS=scene.substeps, ITERS=scene.contact_iters,
        EE_R=scene.ee_radius, OBJ_R=scene.obj_radius, GOAL_R=scene.goal_radius, SPEED=scene.max_speed,
        FRICTION=scene.friction, BLOCK=block, num_warps=warps,
    )  # fmt: skip


def reset_triton(
    state: ResetState,
    tables: Mapping[str, torch.Tensor],
    scene: Scene,
    spawn: float,
    mask: torch.Tensor | None,
    instruction: torch.Tensor | None,
) -> None:
    """Draw the next episode of every slot in ``mask`` (all if None) from its RNG stream, in one
    launch: instruction (``instruction``'s where it is >= 0), end-effector and objects in
    ``[-spawn, spawn]^2`` separated by 8 contact rounds; velocities, tick and success cleared, the
    counter bumped. Every tensor may have any strides; ``tables["split"]`` is contiguous int64."""
    n = state.ee.shape[0]
    if n == 0:
        return
    success = state.success.view(torch.int8)
    k = state.obj.shape[1]
    block, warps = _ticks_launch(n, state.ee.device)
    dummy = state.tick  # stands in for an absent mask or instruction (never read)
    m = dummy if mask is None else mask.view(torch.int8)
    f = dummy if instruction is None else instruction
    _reset_kernel[(triton.cdiv(n, block),)](
        state.ee, state.obj, state.obj_vel, success, state.tick, state.instruction, state.key, state.counter,
        m, f, tables["split"], n, tables["split"].shape[0], *state.ee.stride(), *state.obj.stride(),
        *state.obj_vel.stride(), success.stride(0), state.tick.stride(0), state.instruction.stride(0),
        state.key.stride(0), state.counter.stride(0), m.stride(0), f.stride(0),
        HAS_MASK=mask is not None, HAS_FORCE=instruction is not None, K=k, KP=triton.next_power_of_2(k),
        EE_R=scene.ee_radius, OBJ_R=scene.obj_radius, SPAWN=spawn, BLOCK=block, num_warps=warps,
    )  # fmt: skip


def render_triton(state: State, tables: Mapping[str, torch.Tensor], scene: Scene, out: torch.Tensor) -> None:
    """Render every slot into ``out (slots, H, W, 3)`` uint8 (any strides). ``tables``: ``goals``
    (G, 2) float32, ``colors`` (K, 3) float32 and ``shapes`` (K,) int32 codes, contiguous."""
    n, size = out.shape[0], out.shape[1]
    if n == 0:
        return
    if out.shape[2] != size:
        raise ValueError(f"render_triton: out must be (slots, H, H, 3), got {tuple(out.shape)}")
    bg, goal, ee = scene.background, scene.goal_color, scene.ee_color
    _render_kernel[(n, triton.cdiv(size * size, _RENDER_BLOCK))](
        out, state.ee, state.obj, tables["goals"], tables["colors"], tables["shapes"],
        *out.stride(), *state.ee.stride(), *state.obj.stride(), tables["goals"].shape[0], state.obj.shape[1],
        SIZE=size, EE_R=scene.ee_radius, OBJ_R=scene.obj_radius, GOAL_R=scene.goal_radius,
        BG_R=float(bg[0]), BG_G=float(bg[1]), BG_B=float(bg[2]),
        GOAL_CR=float(goal[0]), GOAL_CG=float(goal[1]), GOAL_CB=float(goal[2]),
        EE_CR=float(ee[0]), EE_CG=float(ee[1]), EE_CB=float(ee[2]), BLOCK=_RENDER_BLOCK,
    )  # fmt: skip
