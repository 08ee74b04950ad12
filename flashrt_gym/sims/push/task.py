"""The tabletop push task on a MuJoCo scene: its configuration, the scene's checked layout, and
the task logic that every backend of the scene shares.

The task is the built-in tabletop's (:mod:`flashrt_gym.sims.tabletop.tabletop`): the same twelve
instructions with the same three held out, the same per-slot counter-based episode draws (so a
seed gives the same instruction and the same start positions in both), the same dense and
sparse rewards and the same success rule (the named object's centre within ``goal_radius`` of
the named goal's centre; a slot that has succeeded is frozen and earns 0). What differs is the
physics: the objects are rigid bodies with mass and friction that slide, spin and collide, so
a push must be planned (approach side, pushing direction) and corrected as the object turns.

The logic here is torch over positions (any device, any float dtype), so the CPU backend
(:mod:`flashrt_gym.sims.push.mujoco_cpu`) and the GPU one (:mod:`flashrt_gym.sims.push.mujoco_warp`) run
the same code around their physics.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mujoco
import numpy as np
import torch

from flashrt.kernels.rng import uniform
from flashrt_gym.sims.tabletop.tabletop import GOALS, TabletopConfig

SCENE = Path(__file__).resolve().parents[2] / "assets" / "mujoco" / "push.xml"
"""The shipped MJCF scene (three objects, four goals, a slide-joint end-effector)."""

_TOL = 1e-6


@dataclass(frozen=True)
class View:
    """A fixed orthographic camera looking down at the table: the image spans the square of
    half-side ``half_extent`` (table units) around ``centre``, turned by ``yaw`` radians
    (counter-clockwise: the image's up direction is the table's +y turned by ``yaw``)."""

    centre: tuple[float, float] = (0.0, 0.0)
    half_extent: float = 1.0
    yaw: float = 0.0


VIEWS = {
    "top": View(),
    "opposite": View(yaw=math.pi),
    "centre": View(half_extent=0.5),
}
"""The named cameras a push scene offers: the whole table (``top``), the whole table from its
far side (``opposite``: turned by half a turn), and its middle at twice the scale (``centre``)."""


@dataclass(frozen=True)
class PushConfig:
    """The push task's parameters.

    Args:
        table: the tabletop's parameters (objects, goals, split, image size, radii, speed, spawn
            box), read as they are: the scene must agree with them (checked on load).
        scene: path of the MJCF scene.
        frame_skip: physics steps per tick (one action); a tick lasts
            ``frame_skip * timestep`` seconds, over which the end-effector moves at most
            ``table.max_speed`` table units.
        cameras: the fixed views rendered for the policy, by name
            (:data:`VIEWS`: ``top``, ``opposite``, ``centre``), in
            the order of the images' camera axis; ``table.image_size`` pixels a side each. One
            (``top``) for the tiny policies; pi0 reads three.
    """

    table: TabletopConfig = field(default_factory=TabletopConfig)
    scene: str | Path = SCENE
    frame_skip: int = 10
    cameras: tuple[str, ...] = ("top",)

    def __post_init__(self) -> None:
        if isinstance(self.table, dict):
            object.__setattr__(self, "table", TabletopConfig(**self.table))
        if not isinstance(self.table, TabletopConfig):
            raise TypeError(f"table must be a TabletopConfig or a dict of its fields, got {type(self.table).__name__}")
        object.__setattr__(self, "scene", Path(self.scene))
        if not self.scene.is_file():
            raise ValueError(f"scene {str(self.scene)!r} is not a file; pass the path of an MJCF scene")
        if int(self.frame_skip) < 1:
            raise ValueError(f"frame_skip must be >= 1, got {self.frame_skip}")
        cameras = (self.cameras,) if isinstance(self.cameras, str) else tuple(self.cameras)
        object.__setattr__(self, "cameras", cameras)
        unknown = [c for c in cameras if c not in VIEWS]
        if not cameras or unknown:
            raise ValueError(f"cameras must name one or more of {sorted(VIEWS)}, got {list(cameras)}")


def cameras_identity(cfg: PushConfig) -> str:
    """The cameras' part of a simulator's identity: empty for the one ``top`` camera (so the
    identities, and the capsules' deployment digests, of single-camera scenes stay as they were)."""
    return "" if cfg.cameras == ("top",) else f"|cameras={','.join(cfg.cameras)}"


def as_push_config(cfg: PushConfig | Mapping[str, Any] | None) -> PushConfig:
    """``cfg`` as a :class:`PushConfig`: itself, the default for None, or built from a mapping
    of its fields (what a Hydra config or ``simulator_kwargs`` of ``gymnasium.make`` holds)."""
    if cfg is None or isinstance(cfg, PushConfig):
        return cfg or PushConfig()
    if not isinstance(cfg, Mapping):
        raise TypeError(f"cfg must be a PushConfig or a mapping of its fields, got {type(cfg).__name__}")
    return PushConfig(**cfg)


@dataclass(frozen=True)
class Footprint:
    """An object's outline seen from above, in its body frame (table units): a circle of
    ``radius``, or a convex polygon of ``vertices`` (counter-clockwise)."""

    kind: Literal["circle", "polygon"]
    radius: float
    vertices: tuple[tuple[float, float], ...] = ()

    def support(self, direction: torch.Tensor, yaw: torch.Tensor) -> torch.Tensor:
        """(slots,) extent of the outline along unit ``direction`` (slots, 2) when the body is
        turned by ``yaw`` (slots,): how far from the centre the outline reaches that way."""
        if self.kind == "circle":
            return torch.full_like(yaw, self.radius)
        v = torch.tensor(self.vertices, dtype=direction.dtype, device=direction.device)  # (V, 2)
        c, s = torch.cos(yaw)[:, None], torch.sin(yaw)[:, None]
        x = v[None, :, 0] * c - v[None, :, 1] * s
        y = v[None, :, 0] * s + v[None, :, 1] * c
        return (x * direction[:, :1] + y * direction[:, 1:]).amax(dim=1)


@dataclass(frozen=True)
class SceneLayout:
    """Where the task's parts live in a compiled scene.

    Attributes:
        ee_qpos: qpos addresses of the end-effector's x and y slide joints.
        ee_dof: their dof addresses.
        ee_actuators: the velocity actuators of x and y.
        obj_qpos: qpos address of each object's free joint (position, then quaternion w x y z).
        obj_dof: dof address of each object's free joint.
        obj_z: each object's resting height (its body's height in the scene).
        footprints: each object's outline.
        tick_seconds: simulated seconds per tick.
    """

    ee_qpos: tuple[int, int]
    ee_dof: tuple[int, int]
    ee_actuators: tuple[int, int]
    obj_qpos: tuple[int, ...]
    obj_dof: tuple[int, ...]
    obj_z: tuple[float, ...]
    footprints: tuple[Footprint, ...]
    tick_seconds: float


def body_name(obj: str) -> str:
    """The scene's body (and free joint, and geom) name of a task object: ``"red square"`` ->
    ``"red_square"``."""
    return obj.replace(" ", "_")


def _id(model: mujoco.MjModel, kind: mujoco.mjtObj, name: str, what: str) -> int:
    i = mujoco.mj_name2id(model, kind, name)
    if i < 0:
        raise ValueError(f"the scene has no {what} named {name!r}; add it (see {SCENE.name}) or fix the task's names")
    return i


def _footprint(model: mujoco.MjModel, geom: int) -> Footprint:
    """The outline of one geom in its body's frame, from the compiled model."""
    kind, size = model.geom_type[geom], model.geom_size[geom]
    rot = np.zeros(9)
    mujoco.mju_quat2Mat(rot, model.geom_quat[geom])
    rot, pos = rot.reshape(3, 3), model.geom_pos[geom]
    name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_GEOM, geom)
    if kind == mujoco.mjtGeom.mjGEOM_CYLINDER:
        if not np.allclose(rot[:, 2], [0, 0, 1]) or not np.allclose(pos[:2], 0):
            raise ValueError(f"geom {name!r}: a cylinder object must stand upright at its body's centre")
        return Footprint("circle", float(size[0]))
    if kind == mujoco.mjtGeom.mjGEOM_BOX:
        corners = np.array([[sx, sy, 0.0] for sx, sy in ((1, 1), (-1, 1), (-1, -1), (1, -1))]) * size
    elif kind == mujoco.mjtGeom.mjGEOM_MESH:
        m = model.geom_dataid[geom]
        start, count = model.mesh_vertadr[m], model.mesh_vertnum[m]
        corners = model.mesh_vert[start : start + count].astype(np.float64)
    else:
        raise ValueError(f"geom {name!r}: object geoms must be boxes, upright cylinders or meshes")
    xy = (corners @ rot.T + pos)[:, :2]
    return Footprint("polygon", float(np.linalg.norm(xy, axis=1).max()), _hull(xy))


def _hull(points: np.ndarray) -> tuple[tuple[float, float], ...]:
    """Convex hull of 2-D points, counter-clockwise (Andrew's monotone chain)."""
    pts = sorted({(round(float(x), 9), round(float(y), 9)) for x, y in points})

    def chain(seq: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for p in seq:
            while len(out) >= 2:
                (ax, ay), (bx, by) = out[-2], out[-1]
                if (bx - ax) * (p[1] - ay) - (by - ay) * (p[0] - ax) > 0:
                    break
                out.pop()
            out.append(p)
        return out

    lower, upper = chain(pts), chain(pts[::-1])
    return tuple(lower[:-1] + upper[:-1])


def load_scene(cfg: PushConfig) -> tuple[mujoco.MjModel, SceneLayout]:
    """Compile ``cfg.scene`` and check it against the task: every object and goal present, the
    goals at the tabletop's positions and radius, the end-effector's radius, every object
    within ``obj_radius`` of its centre, and velocity actuators fast enough for ``max_speed``."""
    table = cfg.table
    try:
        model = mujoco.MjModel.from_xml_path(str(cfg.scene))
    except ValueError as e:
        raise ValueError(f"cannot compile the scene {str(cfg.scene)!r}: {e}") from None
    obj, geom, joint, act = (mujoco.mjtObj.mjOBJ_BODY, mujoco.mjtObj.mjOBJ_GEOM, mujoco.mjtObj.mjOBJ_JOINT,
                             mujoco.mjtObj.mjOBJ_ACTUATOR)  # fmt: skip
    for name in table.goals:
        g = _id(model, geom, f"goal_{name}", "goal geom")
        where, radius = model.geom_pos[g][:2], model.geom_size[g][0]
        if not np.allclose(where, GOALS[name], atol=_TOL) or abs(radius - table.goal_radius) > _TOL:
            raise ValueError(
                f"the scene's goal_{name} is at {where.tolist()} with radius {radius}; the task's is at "
                f"{list(GOALS[name])} with radius {table.goal_radius}: make them agree"
            )
    ee_geom = _id(model, geom, "ee", "end-effector geom")
    if abs(model.geom_size[ee_geom][0] - table.ee_radius) > _TOL:
        raise ValueError(
            f"the scene's end-effector radius is {model.geom_size[ee_geom][0]}, the task's {table.ee_radius}"
        )
    ee_joints = [_id(model, joint, n, "end-effector joint") for n in ("ee_x", "ee_y")]
    if any(model.jnt_type[j] != mujoco.mjtJoint.mjJNT_SLIDE for j in ee_joints):
        raise ValueError("the end-effector joints ee_x and ee_y must be slide joints")
    actuators = [_id(model, act, n, "end-effector actuator") for n in ("ee_x", "ee_y")]
    tick = cfg.frame_skip * model.opt.timestep
    top_speed = table.max_speed / tick
    for a, j in zip(actuators, ee_joints, strict=True):
        if model.actuator_trnid[a][0] != j or model.actuator_biastype[a] != mujoco.mjtBias.mjBIAS_AFFINE:
            raise ValueError(
                f"actuator {model.actuator(a).name!r} must be a velocity actuator on joint {model.joint(j).name!r}"
            )
        if model.actuator_ctrllimited[a] and model.actuator_ctrlrange[a][1] < top_speed - _TOL:
            raise ValueError(
                f"actuator {model.actuator(a).name!r}: ctrlrange reaches {model.actuator_ctrlrange[a][1]}, below the "
                f"top speed {top_speed} (max_speed / (frame_skip * timestep)); widen it or lower max_speed"
            )
    obj_qpos, obj_dof, obj_z, prints = [], [], [], []
    for name in table.objects:
        b = _id(model, obj, body_name(name), "object body")
        j = _id(model, joint, body_name(name), "object free joint")
        if model.jnt_type[j] != mujoco.mjtJoint.mjJNT_FREE or model.jnt_bodyid[j] != b:
            raise ValueError(f"joint {body_name(name)!r} must be the free joint of body {body_name(name)!r}")
        fp = _footprint(model, _id(model, geom, body_name(name), "object geom"))
        if fp.radius > table.obj_radius + _TOL:
            raise ValueError(
                f"object {name!r} reaches {fp.radius:.4f} from its centre, beyond obj_radius {table.obj_radius}"
            )
        obj_qpos.append(int(model.jnt_qposadr[j]))
        obj_dof.append(int(model.jnt_dofadr[j]))
        obj_z.append(float(model.qpos0[model.jnt_qposadr[j] + 2]))
        prints.append(fp)
    layout = SceneLayout(
        ee_qpos=(int(model.jnt_qposadr[ee_joints[0]]), int(model.jnt_qposadr[ee_joints[1]])),
        ee_dof=(int(model.jnt_dofadr[ee_joints[0]]), int(model.jnt_dofadr[ee_joints[1]])),
        ee_actuators=(actuators[0], actuators[1]),
        obj_qpos=tuple(obj_qpos),
        obj_dof=tuple(obj_dof),
        obj_z=tuple(obj_z),
        footprints=tuple(prints),
        tick_seconds=float(tick),
    )
    return model, layout


def model_digest(model: mujoco.MjModel) -> str:
    """SHA-256 of the compiled model's bytes (``mj_saveModel``): two simulators step alike only
    if their models agree, whatever files the scene was compiled from."""
    raw = np.zeros(mujoco.mj_sizeModel(model), dtype=np.uint8)
    mujoco.mj_saveModel(model, None, raw)
    return hashlib.sha256(raw.tobytes()).hexdigest()


def yaw_of(quat: torch.Tensor) -> torch.Tensor:
    """Heading about z of (..., 4) quaternions (w, x, y, z)."""
    w, x, y, z = quat.unbind(-1)
    return torch.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))


class PushTask:
    """The task logic over positions (torch, any device and float dtype).

    Args:
        cfg: the task's parameters.
        layout: the scene's layout (from :func:`load_scene`).
    """

    def __init__(self, cfg: PushConfig, layout: SceneLayout) -> None:
        self.cfg, self.layout = cfg, layout
        table = cfg.table
        self.num_objects = len(table.objects)
        self.combos = table.combos("all")
        self.instructions = [table.instruction(o, g) for o, g in self.combos]
        self.split = [self.combos.index(c) for c in table.combos()]
        self._consts: dict[tuple[torch.device, torch.dtype], dict[str, torch.Tensor]] = {}

    @property
    def observation_dim(self) -> int:
        """Length of :meth:`observation`: ee (2), objects (2K), target one-hot (K), goal one-hot (G)."""
        return 2 + 3 * self.num_objects + len(self.cfg.table.goals)

    def constants(self, device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The task's lookup tables on ``device`` (made at the first call: an in-graph simulator
        makes them when it binds, so that no capture copies them in)."""
        if (device, dtype) not in self._consts:
            table, k = self.cfg.table, self.num_objects
            objs, goals = [o for o, _ in self.combos], [g for _, g in self.combos]
            onehots = torch.cat([torch.eye(k)[objs], torch.eye(len(table.goals))[goals]], dim=1)
            self._consts[device, dtype] = {
                "combos": torch.tensor(self.combos, dtype=torch.int64, device=device),
                "split": torch.tensor(self.split, dtype=torch.int64, device=device),
                "onehots": onehots.to(device),
                "goals": torch.tensor([GOALS[g] for g in table.goals], dtype=dtype, device=device),
            }
        return self._consts[device, dtype]

    # -- episodes ------------------------------------------------------------------------------
    def draw(
        self, key: torch.Tensor, counter: torch.Tensor, instruction: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each slot's next episode from its RNG stream, as the tabletop's ``reset`` draws it:
        (slots,) instruction indices, (slots, 2) end-effector and (slots, K, 2) object positions
        (float32). ``instruction`` (slots,) forces indices where >= 0. The caller bumps the
        counter."""
        table, k = self.cfg.table, self.num_objects
        u = uniform(key, counter, 3 + 2 * k)
        split = self.constants(key.device)["split"]
        drawn = split[(u[:, 0] * len(self.split)).long().clamp_(max=len(self.split) - 1)]
        if instruction is not None:
            drawn = torch.where(instruction >= 0, instruction, drawn)
        ee = (u[:, 1:3] * 2 - 1) * table.spawn
        obj = ((u[:, 3:] * 2 - 1) * table.spawn).view(-1, k, 2)
        for _ in range(8):  # separate overlapping starts (the tabletop's contact rounds)
            obj = self._separate(ee, obj)
        return drawn, ee, obj

    def _separate(self, ee: torch.Tensor, obj: torch.Tensor) -> torch.Tensor:
        """One round of the tabletop's position projection on the bounding circles."""
        table = self.cfg.table
        d = obj - ee[:, None]
        dist = d.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        obj = obj + d / dist * (table.ee_radius + table.obj_radius - dist).clamp_min(0.0)
        if self.num_objects > 1:
            dij = obj[:, :, None] - obj[:, None, :]
            dist = dij.norm(dim=-1, keepdim=True)
            overlap = (2 * table.obj_radius - dist).clamp_min(0.0) * (dist > 1e-6)
            obj = obj + 0.5 * (dij / dist.clamp_min(1e-6) * overlap).sum(dim=2)
        lim = 1.0 - table.obj_radius
        return obj.clamp(-lim, lim)

    # -- rewards and observations --------------------------------------------------------------
    def target_and_goal(self, instruction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots,) target object and (slots,) goal index of each instruction index."""
        combo = self.constants(instruction.device)["combos"][instruction]
        return combo[:, 0], combo[:, 1]

    def distances(
        self, ee: torch.Tensor, obj: torch.Tensor, instruction: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tabletop's two distances: target centre to its goal centre, and end-effector to
        the target's contact ring (``ee_radius + obj_radius`` from its centre, clamped at 0)."""
        table = self.cfg.table
        target, goal = self.target_and_goal(instruction)
        p = obj[torch.arange(obj.shape[0], device=obj.device), target]
        g = self.constants(obj.device, obj.dtype)["goals"][goal]
        ring = (ee - p).norm(dim=-1) - (table.ee_radius + table.obj_radius)
        return (p - g).norm(dim=-1), ring.clamp_min(0.0)

    def rewards(
        self,
        before: tuple[torch.Tensor, torch.Tensor],
        after: tuple[torch.Tensor, torch.Tensor],
        alive: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tick's (dense, sparse) rewards and success from :meth:`distances` before and after
        it, for slots that were ``alive`` (not yet successful) at its start; as the tabletop's."""
        (d_obj0, d_ee0), (d_obj1, d_ee1) = before, after
        success = d_obj1 < self.cfg.table.goal_radius
        newly = (success & alive).to(d_obj1.dtype)
        dense = (5.0 * (d_obj0 - d_obj1) + 1.0 * (d_ee0 - d_ee1) + 2.0 * newly) * alive
        sparse = torch.where(alive & ~success, -1.0, 0.0).to(d_obj1.dtype)
        return dense, sparse, success | ~alive

    def observation(self, ee: torch.Tensor, obj: torch.Tensor, instruction: torch.Tensor) -> torch.Tensor:
        """(slots, observation_dim) float32: end-effector and object positions (clamped to the
        table, ``[-1, 1]``, where the walls keep them anyway), the instruction's target and goal
        one-hots (the tabletop's ``state``); every number lies in ``[-1, 1]``."""
        onehots = self.constants(ee.device)["onehots"][instruction]
        pos = torch.cat([ee, obj.reshape(obj.shape[0], -1)], dim=1).float().clamp(-1.0, 1.0)
        return torch.cat([pos, onehots], dim=1)

    # -- scripted expert -----------------------------------------------------------------------
    def expert(self, ee: torch.Tensor, obj: torch.Tensor, yaw: torch.Tensor, instruction: torch.Tensor) -> torch.Tensor:
        """(slots, 2) action in [-1, 1] of a scripted pusher, from the end-effector (slots, 2),
        object positions (slots, K, 2) and headings (slots, K).

        It plans the push along the line from the target to its goal: the approach side is the
        far side of the target from the goal. Away from that side it circles the target at a
        standoff (the shorter way round) so as not to knock it off course; behind it, it pushes
        towards the goal while steering the contact back onto the line through the target's
        centre, which turns the push as the target slides or spins. The standoff and the push
        point follow the target's outline along the push direction (its yaw matters for the
        box and the prism)."""
        table, lay = self.cfg.table, self.layout
        target, goal = self.target_and_goal(instruction)
        rows = torch.arange(ee.shape[0], device=ee.device)
        p, heading = obj[rows, target], yaw[rows, target]
        g = self.constants(ee.device, ee.dtype)["goals"][goal]
        to_goal = g - p
        u = to_goal / to_goal.norm(dim=-1, keepdim=True).clamp_min(1e-9)
        perp = torch.stack([-u[:, 1], u[:, 0]], dim=-1)
        # extent of the target towards the pusher (-u), per object shape
        extent = torch.zeros_like(heading)
        for k, fp in enumerate(lay.footprints):
            extent = torch.where(target == k, fp.support(-u, heading), extent)
        contact = table.ee_radius + extent
        bound = torch.zeros_like(heading)
        for k, fp in enumerate(lay.footprints):
            bound = torch.where(target == k, fp.radius, bound)
        orbit = table.ee_radius + bound + 0.05  # circling clears the target whatever its heading
        reach = 1.0 - table.ee_radius - 0.005  # inside the end-effector's joint range
        rel = ee - p
        along, side = (rel * u).sum(-1), (rel * perp).sum(-1)
        dist = rel.norm(dim=-1).clamp_min(1e-9)
        # pushing: behind the target, close to the line through its centre
        behind = (along < -0.5 * contact) & (side.abs() < 0.45 * extent)
        push_point = p - u * contact[:, None]
        lateral = ((push_point - ee) * perp).sum(-1, keepdim=True) * perp
        push = u + 0.5 * lateral / table.max_speed
        # approaching: straight to the staging point behind the target once on its side; from
        # elsewhere around the target: to the tangent point of the orbit circle on the shorter
        # way round, then along the circle
        staging = (p - u * (contact + 0.04)[:, None]).clamp(-reach, reach)
        angle_ee = torch.atan2(rel[:, 1], rel[:, 0])
        angle_to = torch.atan2(-u[:, 1], -u[:, 0])
        turn = torch.remainder(angle_to - angle_ee + math.pi, 2 * math.pi) - math.pi
        way = torch.where(turn >= 0, 1.0, -1.0)
        radial = rel / dist[:, None]
        tangent = torch.stack([-radial[:, 1], radial[:, 0]], dim=-1) * way[:, None]
        around = tangent * table.max_speed + 2.0 * (orbit - dist)[:, None] * radial
        angle_tp = angle_ee + way * torch.acos((orbit / dist).clamp(max=1.0))
        tangent_point = p + orbit[:, None] * torch.stack([torch.cos(angle_tp), torch.sin(angle_tp)], dim=-1)
        far = dist > 1.1 * orbit
        detour = torch.where(far[:, None], tangent_point.clamp(-reach, reach) - ee, around)
        clear = turn.abs() < 0.5
        approach = torch.where(clear[:, None], staging - ee, detour) / table.max_speed
        action = torch.where(behind[:, None], push, approach)
        return action.clamp(-1.0, 1.0)
