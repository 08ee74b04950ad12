"""The push task on MuJoCo's C library: ``num_slots`` ``MjData`` on one ``MjModel``, on the CPU.

An :class:`~flashrt_gym.simulator.ExternalSimulator`: the env wraps it in a device mirror of its
state and steps it on the host between the policy's graphs. A slot's state is one row of
``state_nbytes`` bytes: MuJoCo's integration state (``mj_getState`` with
``mjSTATE_INTEGRATION``: time, qpos, qvel, act, the solver's warm start, ctrl, applied forces,
... float64), then the task's int64 fields (instruction, tick, success, RNG key, RNG counter).
The integration state is every input of ``mj_step``, so restoring a row and stepping gives the
bytes the uninterrupted run gives. Position and velocity alone are not enough: the constraint
solver starts from the previous step's accelerations (the warm start), and from another start
its iterations stop at other bits, which contacts then amplify.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mujoco
import numpy as np
import torch

from flashrt_gym.assets import TINY_MUJOCO
from flashrt_gym.sims.push.render import TopDownRenderer
from flashrt_gym.sims.push.task import (
    VIEWS,
    PushConfig,
    PushTask,
    as_push_config,
    cameras_identity,
    load_scene,
    model_digest,
    yaw_of,
)
from flashrt_gym.sims.tabletop.tabletop import BACKGROUND, COLORS, EE_COLOR, GOAL_COLOR, GOALS

STATE_SIG = int(mujoco.mjtState.mjSTATE_INTEGRATION)
"""The ``mj_getState`` signature a slot's state row holds."""

TASK_FIELDS = ("instruction", "tick", "success", "key", "counter")
"""The task's int64 fields after the physics in a state row, in order."""


def _host(x: Any) -> np.ndarray:
    """An array-like (NumPy, list, or torch tensor on any device) as a NumPy array."""
    return np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x)


def renderer_for(cfg: PushConfig, task: PushTask) -> TopDownRenderer:
    """The top-down renderer of the scene's geoms in the tabletop's colours."""
    table = cfg.table
    return TopDownRenderer(
        task.layout.footprints,
        [COLORS[o.split()[0]] for o in table.objects],
        [GOALS[g] for g in table.goals],
        table.goal_radius,
        table.ee_radius,
        table.image_size,
        BACKGROUND,
        GOAL_COLOR,
        EE_COLOR,
        [VIEWS[c] for c in cfg.cameras],
    )


class MujocoPush:
    """The batched push simulator on the CPU, an external simulator.

    Args:
        num_slots: parallel episodes.
        cfg: the task's parameters, or a mapping of them (default: the shipped scene and the
            tabletop's defaults).
        threads: CPU threads that step the slots (MuJoCo releases the GIL while it steps); each
            slot's physics is its own, so the results are the same bytes for any count.
    """

    action_dim = 2
    proprio_dim = 2
    observation_bound = 1.0
    physics_signature = STATE_SIG
    """What a state row holds of MuJoCo's state (an ``mjtState`` signature)."""
    pretrained_weights = TINY_MUJOCO
    """The policy the env loads when it is given no weights: the tiny VLA trained on this task."""

    def __init__(self, num_slots: int, cfg: PushConfig | Mapping[str, Any] | None = None, threads: int = 1) -> None:
        if isinstance(num_slots, bool) or int(num_slots) < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1 (e.g. os.cpu_count()), got {threads!r}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mujoco") if threads > 1 else None
        self.cfg = cfg = as_push_config(cfg)
        self.num_slots = int(num_slots)
        self.model, self.layout = load_scene(cfg)
        self.task = PushTask(cfg, self.layout)
        self.instructions = self.task.instructions
        self.image_size = cfg.table.image_size
        self.num_cameras = len(cfg.cameras)
        self.observation_dim = self.task.observation_dim
        self.data = [mujoco.MjData(self.model) for _ in range(self.num_slots)]
        self.physics_size = mujoco.mj_stateSize(self.model, self.physics_signature)
        self.state_nbytes = 8 * (self.physics_size + len(TASK_FIELDS))
        self._digest = model_digest(self.model)
        self._vars = np.zeros((self.num_slots, len(TASK_FIELDS)), dtype=np.int64)
        lay = self.layout
        self._ee = np.array(lay.ee_qpos)
        self._obj = np.array(lay.obj_qpos)[:, None] + np.arange(7)  # (K, 7): x y z qw qx qy qz
        self._act = np.array(lay.ee_actuators)
        self._speed = cfg.table.max_speed / lay.tick_seconds  # ctrl at |action| = 1
        self.renderer = renderer_for(cfg, self.task)
        for d in self.data:
            mujoco.mj_forward(self.model, d)

    def identity(self) -> str:
        """The compiled model, the task's parameters and what a state row holds."""
        return (
            f"mujoco-push|model={self._digest}|{sorted(self.cfg.table.to_dict().items())}|"
            f"frame_skip={self.cfg.frame_skip}|signature={self.physics_signature}{cameras_identity(self.cfg)}"
        )

    # -- task fields ---------------------------------------------------------------------------
    def _field(self, name: str) -> np.ndarray:
        return self._vars[:, TASK_FIELDS.index(name)]

    def instruction(self) -> np.ndarray:
        """(slots,) int64 index into :attr:`instructions` of each slot's instruction (a copy)."""
        return self._field("instruction").copy()

    def success(self) -> np.ndarray:
        """(slots,) bool: the slot's episode has succeeded (it is frozen until reset)."""
        return self._field("success") != 0

    def ticks(self) -> np.ndarray:
        """(slots,) int64 ticks run in the current episode (a copy)."""
        return self._field("tick").copy()

    def _mask(self, mask: Any) -> np.ndarray:
        if mask is None:
            return np.ones(self.num_slots, dtype=bool)
        m = _host(mask)
        if m.dtype != np.bool_ or m.shape != (self.num_slots,):
            raise ValueError(f"mask must be a bool array of shape ({self.num_slots},), got {m.dtype} {m.shape}")
        return m

    def _slots(self, slots: Any) -> np.ndarray:
        if slots is None:
            return np.arange(self.num_slots)
        s = _host(slots)
        if s.ndim != 1 or (s.size and s.dtype.kind not in "iu"):
            raise ValueError(f"slots must be a 1-D sequence of slot indices, got {s.dtype} {s.shape}")
        s = s.astype(np.int64)
        if s.size and (s.min() < 0 or s.max() >= self.num_slots):
            raise ValueError(f"slot indices must lie in [0, {self.num_slots}), got {s.tolist()}")
        if len(set(s.tolist())) != s.size:
            raise ValueError(f"slot indices must be distinct, got {s.tolist()}")
        return s

    # -- episodes ------------------------------------------------------------------------------
    def seed(self, seeds: Any, slots: Any = None) -> None:
        """Restart the RNG stream of each slot (all, or ``slots``) from its int64 seed: the next
        :meth:`reset` of the slot draws the stream's first episode."""
        s = self._slots(slots)
        k = _host(seeds)
        if k.shape != (s.size,) or (k.size and k.dtype.kind not in "iu"):
            raise ValueError(f"seeds must be {s.size} integers, one per slot, got {k.dtype} {k.shape}")
        self._vars[s, TASK_FIELDS.index("key")] = k.astype(np.int64)
        self._vars[s, TASK_FIELDS.index("counter")] = 0

    def reset(self, mask: Any = None, instruction: Any = None) -> None:
        """Draw the next episode of each slot's stream where ``mask`` (all slots if None): the
        tabletop's draws (the same key and counter start the same instruction and positions),
        a cold MuJoCo state (zero velocities and warm start), objects upright. ``instruction``
        (slots,) int64 forces instruction indices where >= 0 (the expert's evaluations)."""
        m = self._mask(mask)
        forced = None
        if instruction is not None:
            forced = torch.as_tensor(_host(instruction))
            n = len(self.instructions)
            if forced.shape != (self.num_slots,) or forced.dtype != torch.int64 or int(forced.max()) >= n:
                raise ValueError(f"instruction must be ({self.num_slots},) int64 indices below {n} (-1 keeps the draw)")
        key = torch.from_numpy(self._field("key").copy())
        counter = torch.from_numpy(self._field("counter").copy())
        drawn, ee, obj = (t.numpy() for t in self.task.draw(key, counter, forced))
        lay = self.layout
        for i in np.flatnonzero(m):
            d = self.data[i]
            mujoco.mj_resetData(self.model, d)
            d.qpos[self._ee] = ee[i]
            for k in range(self.task.num_objects):
                d.qpos[self._obj[k]] = [*obj[i, k], lay.obj_z[k], 1.0, 0.0, 0.0, 0.0]
            mujoco.mj_forward(self.model, d)
        self._field("instruction")[m] = drawn[m]
        self._field("tick")[m] = 0
        self._field("success")[m] = 0
        self._field("counter")[m] += 1

    def set_instruction(self, index: int, slots: Any = None) -> None:
        """Give ``slots`` (all if None) the instruction ``index`` from the next tick on."""
        if isinstance(index, bool) or not 0 <= int(index) < len(self.instructions):
            raise ValueError(f"instruction index must be an int in [0, {len(self.instructions)}), got {index!r}")
        self._vars[self._slots(slots), TASK_FIELDS.index("instruction")] = int(index)

    # -- physics -------------------------------------------------------------------------------
    def _qpos(self) -> np.ndarray:
        return np.stack([d.qpos for d in self.data])

    def poses(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, 2) end-effector positions, (slots, K, 2) object positions and (slots, K) object
        headings, float64 tensors."""
        q = torch.from_numpy(self._qpos())
        obj = q[:, self._obj]  # (N, K, 7)
        return q[:, self._ee], obj[..., :2], yaw_of(obj[..., 3:7])

    def run_ticks(self, actions: Any) -> tuple[np.ndarray, np.ndarray]:
        """Advance every slot ``T`` ticks under ``actions`` (slots, T, 2) in [-1, 1] (clipped);
        each tick is ``frame_skip`` physics steps at the commanded end-effector velocity.
        Slots that have succeeded are frozen (not stepped) and earn nothing.

        Returns:
            (dense, sparse) rewards summed over the ticks, each (slots,) float32.
        """
        a = _host(actions).astype(np.float64)
        if a.ndim != 3 or a.shape[0] != self.num_slots or a.shape[2] != self.action_dim:
            raise ValueError(f"actions must have shape ({self.num_slots}, T, {self.action_dim}), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("actions contain NaN or infinity")
        a = np.clip(a, -1.0, 1.0) * self._speed
        dense = torch.zeros(self.num_slots, dtype=torch.float64)
        sparse = torch.zeros(self.num_slots, dtype=torch.float64)
        instr = torch.from_numpy(self._field("instruction").copy())
        ee, obj, _ = self.poses()
        before = self.task.distances(ee, obj, instr)
        for t in range(a.shape[1]):
            alive = ~self.success()
            self._step(np.flatnonzero(alive), a[:, t])
            ee, obj, _ = self.poses()
            after = self.task.distances(ee, obj, instr)
            dn, sp, success = self.task.rewards(before, after, torch.from_numpy(alive))
            dense += dn
            sparse += sp
            self._field("success")[:] = success.numpy()
            self._field("tick")[alive] += 1
            before = after
        return dense.float().numpy(), sparse.float().numpy()

    def _step(self, slots: np.ndarray, ctrl: np.ndarray) -> None:
        """One tick of ``slots`` at end-effector commands ``ctrl`` (slots, 2), over the threads."""

        def tick(part: np.ndarray) -> None:
            for i in part:
                d = self.data[i]
                d.ctrl[self._act] = ctrl[i]
                mujoco.mj_step(self.model, d, nstep=self.cfg.frame_skip)

        if self._pool is None or len(slots) < 2:
            tick(slots)
        else:
            list(self._pool.map(tick, np.array_split(slots, min(self.threads, len(slots)))))

    # -- observations --------------------------------------------------------------------------
    def observation(self) -> np.ndarray:
        """(slots, observation_dim) float32 low-dimensional observation (the tabletop's ``state``)."""
        ee, obj, _ = self.poses()
        return self.task.observation(ee, obj, torch.from_numpy(self._field("instruction").copy())).numpy()

    def proprio(self) -> np.ndarray:
        """(slots, 2) float32 end-effector position: the policy's proprioceptive input."""
        return self._qpos()[:, self._ee].astype(np.float32)

    def render(self) -> np.ndarray:
        """(slots, num_cameras, H, W, 3) uint8 top-down images of the configured views
        (:class:`~flashrt_gym.sims.push.render.TopDownRenderer`)."""
        return self.renderer(*self.poses()).numpy()

    def expert(self) -> np.ndarray:
        """(slots, 2) float32 actions of the scripted pusher (:meth:`PushTask.expert`)."""
        ee, obj, yaw = self.poses()
        instr = torch.from_numpy(self._field("instruction").copy())
        return self.task.expert(ee, obj, yaw, instr).float().numpy()

    # -- state ---------------------------------------------------------------------------------
    def get_state(self, slots: Any = None) -> np.ndarray:
        """(len(slots), state_nbytes) uint8 rows of the slots' whole state (all slots if None)."""
        s = self._slots(slots)
        out = np.empty((s.size, self.physics_size + len(TASK_FIELDS)), dtype=np.float64)
        for row, i in enumerate(s):
            mujoco.mj_getState(self.model, self.data[i], out[row, : self.physics_size], self.physics_signature)
        out[:, self.physics_size :] = self._vars[s].view(np.float64)
        return out.view(np.uint8)

    def set_state(self, slots: Any, states: Any) -> None:
        """Write rows of :meth:`get_state` (of this scene) into ``slots`` (all if None).
        All-or-nothing: every row is checked before any slot changes."""
        s = self._slots(slots)
        rows = _host(states)
        if rows.dtype != np.uint8 or rows.shape != (s.size, self.state_nbytes):
            raise ValueError(
                f"states must be uint8 of shape ({s.size}, {self.state_nbytes}) (rows of get_state), got "
                f"{rows.dtype} {rows.shape}"
            )
        rows = np.ascontiguousarray(rows)
        physics = rows[:, : 8 * self.physics_size].view(np.float64)
        fields = rows[:, 8 * self.physics_size :].view(np.int64)
        bad = []
        if not np.isfinite(physics).all():
            bad.append("non-finite physics values")
        instr, tick, success, counter = (fields[:, TASK_FIELDS.index(n)] for n in (*TASK_FIELDS[:3], "counter"))
        if ((instr < 0) | (instr >= len(self.instructions))).any():
            bad.append(f"instruction indices outside [0, {len(self.instructions)})")
        if (tick < 0).any() or (counter < 0).any() or ((success != 0) & (success != 1)).any():
            bad.append("negative ticks or counters, or success flags other than 0/1")
        if bad:
            raise ValueError(
                f"states are not rows of this simulator's get_state: {', '.join(bad)}; nothing was written"
            )
        for row, i in enumerate(s):
            mujoco.mj_setState(self.model, self.data[i], physics[row], self.physics_signature)
        self._vars[s] = fields
