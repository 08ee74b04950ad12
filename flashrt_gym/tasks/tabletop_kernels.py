"""The tabletop's hot path as two Triton kernels: all ticks of an action chunk, and the render.

:meth:`Tabletop.step <flashrt_gym.tasks.Tabletop.step>` (one tick) and
:meth:`Tabletop.render <flashrt_gym.tasks.Tabletop.render>` in torch are the references: a tick
is about 150 small kernels (substeps x contact rounds of elementwise work on ``(N, K, 2)``
tensors) and the render about 40, all launch-bound. Here one program owns a block of slots and
runs every tick of the chunk with the state in registers (one launch per chunk), and one
program renders a block of pixels of one slot straight into the policy's image buffer. The
arithmetic follows the references operation by operation; results agree to float32 rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashrt.kernels.backend import sm_count, tl, triton
from flashrt.runtime import BufferSet

if TYPE_CHECKING:
    from flashrt_gym.tasks.tabletop import Tabletop

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
        n, s_ee, s_obj, s_vel, s_succ, s_tick, s_inst, s_an, s_at, s_dense, s_sparse, T,
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
        ey = tl.load(ee + r * s_ee + 1, mask=live, other=0.0)
        ptr_o = obj + r[:, None] * s_obj + kk[None, :] * 2
        ptr_v = vel + r[:, None] * s_vel + kk[None, :] * 2
        far = 100.0 + 10.0 * kk[None, :].to(tl.float32)  # padding objects sit far apart, never touch
        ox = tl.load(ptr_o, mask=m2, other=0.0) + tl.where(valid[None, :], 0.0, far)
        oy = tl.load(ptr_o + 1, mask=m2, other=0.0)
        vx = tl.load(ptr_v, mask=m2, other=0.0)
        vy = tl.load(ptr_v + 1, mask=m2, other=0.0)
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
            ay = tl.load(actions + r * s_an + t * s_at + 1, mask=live, other=0.0)
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
        tl.store(ee + r * s_ee + 1, ey, mask=live)
        tl.store(ptr_o, ox, mask=m2)
        tl.store(ptr_o + 1, oy, mask=m2)
        tl.store(ptr_v, vx, mask=m2)
        tl.store(ptr_v + 1, vy, mask=m2)
        tl.store(success + r * s_succ, done.to(tl.int8), mask=live)
        tl.store(tick + r * s_tick, ticks, mask=live)
        tl.store(dense_out + r * s_dense, dense, mask=live)
        tl.store(sparse_out + r * s_sparse, sparse, mask=live)

    @triton.jit
    def _render_kernel(
        out, ee, obj, goals, colors, shapes, s_out, s_ee, s_obj, n_goals, n_objects,
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
            dx = px - tl.load(obj + s * s_obj + 2 * k)
            dy = py - tl.load(obj + s * s_obj + 2 * k + 1)
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
        on_ee = _norm(px - tl.load(ee + s * s_ee), py - tl.load(ee + s * s_ee + 1)) < EE_R
        cr = tl.where(on_ee, EE_CR, cr)
        cg = tl.where(on_ee, EE_CG, cg)
        cb = tl.where(on_ee, EE_CB, cb)
        dst = out + s * s_out + p * 3
        tl.store(dst, cr.to(tl.uint8), mask=inside_img)
        tl.store(dst + 1, cg.to(tl.uint8), mask=inside_img)
        tl.store(dst + 2, cb.to(tl.uint8), mask=inside_img)


_RENDER_BLOCK = 1024


def _ticks_launch(n: int, device: torch.device) -> tuple[int, int]:
    """(slots a program, warps) of the ticks kernel. A program's contact rounds are a serial
    chain of small reductions: with up to one program per SM, two slots in one warp (no
    cross-warp reductions); beyond that, blocks of 16 in four warps. On an H200 (4 ticks of 2
    substeps x 3 contact rounds) one slot took 7.5 us against 23 with the former 64 slots in four
    warps, and 4096 slots 12.6 against 26 us; every shape gives the same bytes."""
    return (2, 1) if triton.cdiv(n, 2) <= sm_count(device) else (16, 4)


def ticks_triton(
    task: Tabletop, b: BufferSet, actions: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tick of ``actions (slots, T, 2)`` in one launch; returns the summed (dense, sparse),
    written into ``out`` (two float32 ``(slots,)`` views, any stride) when given."""
    cfg, c, n = task.cfg, task._c(b.device), b.num_slots
    dense, sparse = out if out is not None else (torch.empty(n, device=b.device), torch.empty(n, device=b.device))
    if n == 0:
        return dense, sparse
    ee, obj, vel = b["sim.ee"], b["sim.obj"], b["sim.obj_vel"]
    success, tick, inst = b["sim.success"].view(torch.int8), b["sim.tick"], b["sim.instruction"]
    block, warps = _ticks_launch(n, b.device)
    _ticks_kernel[(triton.cdiv(n, block),)](
        ee, obj, vel, success, tick, inst, actions, c["combos"], c["goals"], dense, sparse,
        n, ee.stride(0), obj.stride(0), vel.stride(0), success.stride(0), tick.stride(0), inst.stride(0),
        actions.stride(0), actions.stride(1), dense.stride(0), sparse.stride(0), actions.shape[1],
        K=task.num_objects, KP=triton.next_power_of_2(task.num_objects), SUBSTEPS=cfg.substeps, ITERS=cfg.contact_iters,
        EE_R=cfg.ee_radius, OBJ_R=cfg.obj_radius, GOAL_R=cfg.goal_radius, SPEED=cfg.max_speed,
        FRICTION=cfg.friction, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return dense, sparse


def render_triton(task: Tabletop, b: BufferSet, out: torch.Tensor) -> None:
    """Render every slot into ``out (slots, H, W, 3)`` uint8 (a view with contiguous rows)."""
    from flashrt_gym.tasks.tabletop import BACKGROUND, EE_COLOR, GOAL_COLOR

    cfg, c, n = task.cfg, task._c(b.device), b.num_slots
    size = cfg.image_size
    if n == 0:
        return
    _render_kernel[(n, triton.cdiv(size * size, _RENDER_BLOCK))](
        out, b["sim.ee"], b["sim.obj"], c["goals"], c["colors"], c["shape_codes"],
        out.stride(0), b["sim.ee"].stride(0), b["sim.obj"].stride(0), len(cfg.goals), task.num_objects,
        SIZE=size, EE_R=cfg.ee_radius, OBJ_R=cfg.obj_radius, GOAL_R=cfg.goal_radius,
        BG_R=float(BACKGROUND[0]), BG_G=float(BACKGROUND[1]), BG_B=float(BACKGROUND[2]),
        GOAL_CR=float(GOAL_COLOR[0]), GOAL_CG=float(GOAL_COLOR[1]), GOAL_CB=float(GOAL_COLOR[2]),
        EE_CR=float(EE_COLOR[0]), EE_CG=float(EE_COLOR[1]), EE_CB=float(EE_COLOR[2]), BLOCK=_RENDER_BLOCK,
    )  # fmt: skip
