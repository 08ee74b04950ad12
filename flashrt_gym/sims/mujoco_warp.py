"""The push task on MuJoCo Warp: ``num_slots`` worlds of the same scene on one CUDA GPU, whose
whole state is slot buffers.

An in-graph simulator: a slot's state is ``sim.physics`` (MuJoCo Warp's ``get_state`` row with
the integration signature, float32: time, qpos, qvel, the solver's warm start, ctrl, ...) and
the task's ``sim.instruction``, ``sim.tick``, ``sim.success``, ``sim.key``, ``sim.counter``, all
in the env's :class:`~flashrt.runtime.BufferSet`, so capsules are byte copies of them. MuJoCo
Warp's ``Data`` is scratch: each tick loads it from the rows (``set_state``), steps it
``frame_skip`` times and writes the worlds still running back (``get_state`` with the alive
mask; a world that has succeeded stays frozen).

One :meth:`WarpPush.run_ticks` is three parts on the torch stream, with no host
synchronisation between them:

- :meth:`WarpPush.ticks_begin` (torch, capturable in the env's graph): rows, actions, targets
  into the scratch that Warp reads;
- :meth:`WarpPush.ticks_physics`: every tick's physics and task kernels (control from the
  action, load, steps, store, rewards and success) as one Warp program, replayed as Warp's own
  captured graph (MuJoCo Warp's solver loop is a conditional graph node that cannot be recorded
  inside a torch capture);
- :meth:`WarpPush.ticks_end` (torch, capturable): rows, flags and summed rewards back.

``reset``, ``render``, ``observation``, ``proprio`` and ``expert`` are torch programs over the
rows (capturable). ``warp`` and ``mujoco_warp`` are imported when a :class:`WarpPush` is made,
never by ``import flashrt_gym.sims``.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any

import mujoco
import numpy as np
import torch

from flashrt.runtime import BufferSet, BufferSpec, slot
from flashrt_gym.sims.push import PushConfig, PushTask, load_scene, yaw_of
from flashrt_gym.sims.render import TopDownRenderer
from flashrt_gym.tasks.tabletop import BACKGROUND, COLORS, EE_COLOR, GOAL_COLOR, GOALS

STATE_SIG = int(mujoco.mjtState.mjSTATE_INTEGRATION)


def state_offsets(model: mujoco.MjModel, sig: int = STATE_SIG) -> dict[str, int]:
    """Where qpos and ctrl start in a state row of signature ``sig`` (found by writing marks into
    the fields of a fresh ``MjData`` and reading them back through ``mj_getState``)."""
    d = mujoco.MjData(model)
    d.qpos[:] = np.arange(model.nq) + 1e6
    d.ctrl[:] = np.arange(model.nu) + 2e6
    row = np.empty(mujoco.mj_stateSize(model, sig))
    mujoco.mj_getState(model, d, row, sig)
    found = {}
    for name, mark, n in (("qpos", 1e6, model.nq), ("ctrl", 2e6, model.nu)):
        at = np.flatnonzero(row == mark)
        if at.size != 1 or not np.array_equal(row[at[0] : at[0] + n], np.arange(n) + mark):
            raise ValueError(f"state signature {sig} does not hold {name}; use one that includes it")
        found[name] = int(at[0])
    return found


@functools.cache
def warp_api() -> SimpleNamespace:
    """Import Warp and MuJoCo Warp, and define the task's kernels (once)."""
    try:
        import mujoco_warp as mjw
        import warp as wp
    except ImportError as e:
        raise ImportError(
            "the MuJoCo Warp simulator needs `pip install mujoco-warp` (it brings warp-lang) and a CUDA GPU"
        ) from e
    wp.init()

    @wp.func
    def distances(state: wp.array2d(dtype=wp.float32), w: int, ee: int, obj: int, goal: wp.vec2, ring_r: float):
        px = state[w, obj]
        py = state[w, obj + 1]
        dx = state[w, ee] - px
        dy = state[w, ee + 1] - py
        return wp.vec2(wp.length(wp.vec2(px, py) - goal), wp.max(wp.sqrt(dx * dx + dy * dy) - ring_r, 0.0))

    @wp.kernel
    def write_ctrl(
        state: wp.array2d(dtype=wp.float32),
        actions: wp.array3d(dtype=wp.float32),
        alive: wp.array(dtype=wp.bool),
        t: int,
        ctrl: int,
        speed: float,
    ):
        w = wp.tid()
        if not alive[w]:  # a frozen world keeps its whole row
            return
        state[w, ctrl] = wp.clamp(actions[w, t, 0], -1.0, 1.0) * speed
        state[w, ctrl + 1] = wp.clamp(actions[w, t, 1], -1.0, 1.0) * speed

    @wp.kernel
    def measure(
        state: wp.array2d(dtype=wp.float32),
        ee: int,
        obj: wp.array(dtype=wp.int32),
        goal: wp.array(dtype=wp.vec2),
        ring_r: float,
        dist: wp.array(dtype=wp.vec2),
    ):
        w = wp.tid()
        dist[w] = distances(state, w, ee, obj[w], goal[w], ring_r)

    @wp.kernel
    def score(
        state: wp.array2d(dtype=wp.float32),
        ee: int,
        obj: wp.array(dtype=wp.int32),
        goal: wp.array(dtype=wp.vec2),
        ring_r: float,
        goal_radius: float,
        dist: wp.array(dtype=wp.vec2),
        alive: wp.array(dtype=wp.bool),
        tick: wp.array(dtype=wp.int64),
        dense: wp.array(dtype=wp.float32),
        sparse: wp.array(dtype=wp.float32),
    ):
        w = wp.tid()
        after = distances(state, w, ee, obj[w], goal[w], ring_r)
        if alive[w]:
            before = dist[w]
            success = after[0] < goal_radius
            sparse[w] = sparse[w] - wp.where(success, 0.0, 1.0)
            dense[w] = dense[w] + 5.0 * (before[0] - after[0]) + (before[1] - after[1]) + wp.where(success, 2.0, 0.0)
            tick[w] = tick[w] + wp.int64(1)
            alive[w] = not success
        dist[w] = after

    return SimpleNamespace(wp=wp, mjw=mjw, write_ctrl=write_ctrl, measure=measure, score=score)


class WarpPush:
    """The batched push simulator on MuJoCo Warp.

    Args:
        num_slots: worlds (parallel episodes); the buffer sets it runs on must have this many slots.
        cfg: the task's parameters.
        device: a CUDA device (``"cpu"`` runs Warp's CPU backend, eagerly: for tests of the
            logic, slow to compile).
        graph: replay the physics as Warp's captured graph (CUDA only); eager launches otherwise.
        nconmax, njmax: MuJoCo Warp's contact and constraint capacities per world.
    """

    action_dim = 2
    proprio_dim = 2

    def __init__(
        self,
        num_slots: int,
        cfg: PushConfig | None = None,
        device: str | torch.device = "cuda",
        *,
        graph: bool = True,
        nconmax: int = 32,
        njmax: int = 160,
    ) -> None:
        if int(num_slots) < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.k = k = warp_api()
        self.cfg = cfg = cfg or PushConfig()
        self.num_slots = n = int(num_slots)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.graph = bool(graph) and self.device.type == "cuda"
        self.mjm, self.layout = load_scene(cfg)
        self.task = PushTask(cfg, self.layout)
        self.instructions = self.task.instructions
        self.image_size = cfg.table.image_size
        self.wp_device = k.wp.device_from_torch(self.device)
        with k.wp.ScopedDevice(self.wp_device):
            self.m = k.mjw.put_model(self.mjm)
            self.d = k.mjw.make_data(self.mjm, nworld=n, nconmax=nconmax, njmax=njmax)
        self.nstate = mujoco.mj_stateSize(self.mjm, STATE_SIG)
        off = state_offsets(self.mjm)
        lay = self.layout
        self._ee = off["qpos"] + lay.ee_qpos[0]
        if lay.ee_qpos[1] != lay.ee_qpos[0] + 1 or list(lay.ee_actuators) != [0, 1]:
            raise ValueError("the scene must declare ee_x then ee_y, and their two actuators first")
        self._ctrl = off["ctrl"]
        self._obj = torch.tensor([off["qpos"] + a for a in lay.obj_qpos], device=self.device)
        self._speed = cfg.table.max_speed / lay.tick_seconds
        cold = mujoco.MjData(self.mjm)
        row = np.empty(self.nstate)
        mujoco.mj_getState(self.mjm, cold, row, STATE_SIG)
        self._cold = torch.tensor(row, dtype=torch.float32, device=self.device)
        f32 = {"dtype": torch.float32, "device": self.device}
        self._state = torch.zeros(n, self.nstate, **f32)  # scratch: what Warp loads and stores
        self._target_adr = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._goal = torch.zeros(n, 2, **f32)
        self._dist = torch.zeros(n, 2, **f32)
        self._alive = torch.zeros(n, dtype=torch.bool, device=self.device)
        self._tick = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._dense = torch.zeros(n, **f32)
        self._sparse = torch.zeros(n, **f32)
        self._scratch = (self._state, self._dist, self._alive, self._tick, self._dense, self._sparse)
        self._programs: dict[int, dict[str, Any]] = {}
        self._streams: dict[int, Any] = {}
        table = cfg.table
        self.renderer = TopDownRenderer(
            lay.footprints,
            [COLORS[o.split()[0]] for o in table.objects],
            [GOALS[g] for g in table.goals],
            table.goal_radius,
            table.ee_radius,
            table.image_size,
            BACKGROUND,
            GOAL_COLOR,
            EE_COLOR,
        )

    # -- layout --------------------------------------------------------------------------------
    def specs(self) -> list[BufferSpec]:
        """The per-slot state buffers (the simulator's whole state)."""
        return [
            slot("sim.physics", (self.nstate,)),
            slot("sim.instruction", (), torch.int64),
            slot("sim.tick", (), torch.int64),
            slot("sim.success", (), torch.bool),
            slot("sim.key", (), torch.int64),
            slot("sim.counter", (), torch.int64),
        ]

    @property
    def state_dim(self) -> int:
        return self.task.observation_dim

    def _check(self, b: BufferSet) -> None:
        if b.num_slots != self.num_slots or b.device != self.device:
            raise ValueError(
                f"this simulator runs {self.num_slots} worlds on {self.device}; the buffer set has "
                f"{b.num_slots} slots on {b.device}: make the simulator with the set's slots and device"
            )

    def poses(self, b: BufferSet) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, 2) end-effector, (slots, K, 2) object positions and (slots, K) headings."""
        phys = b["sim.physics"]
        obj = phys[:, self._obj[:, None] + torch.arange(7, device=self.device)]
        return phys[:, self._ee : self._ee + 2], obj[..., :2], yaw_of(obj[..., 3:7])

    # -- episodes (torch) ----------------------------------------------------------------------
    def seed(self, b: BufferSet, seeds: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Set each slot's RNG key from an int64 seed (and zero its counter), where ``mask``."""
        keep = torch.ones_like(b["sim.success"]) if mask is None else mask
        b["sim.key"].copy_(torch.where(keep, seeds.to(b.device, torch.int64), b["sim.key"]))
        b["sim.counter"].masked_fill_(keep, 0)

    def reset(self, b: BufferSet, mask: torch.Tensor | None = None, instruction: torch.Tensor | None = None) -> None:
        """Draw a new episode from each slot's RNG where ``mask`` (all if None): the tabletop's
        draws into a cold state row (zero velocity and warm start, objects upright).
        ``instruction`` (slots,) forces instruction indices where >= 0."""
        self._check(b)
        m = torch.ones_like(b["sim.success"]) if mask is None else mask
        drawn, ee, obj = self.task.draw(b["sim.key"], b["sim.counter"], instruction)
        rows = self._cold.expand(self.num_slots, -1).clone()
        rows[:, self._ee : self._ee + 2] = ee
        rows[:, self._obj] = obj[..., 0]
        rows[:, self._obj + 1] = obj[..., 1]
        b["sim.physics"].copy_(torch.where(m[:, None], rows, b["sim.physics"]))
        b["sim.instruction"].copy_(torch.where(m, drawn, b["sim.instruction"]))
        b["sim.tick"].masked_fill_(m, 0)
        b["sim.success"].masked_fill_(m, False)
        b["sim.counter"].add_(m.long())

    # -- the ticks -----------------------------------------------------------------------------
    def _program(self, ticks: int) -> dict[str, Any]:
        """Scratch and (on CUDA) the captured Warp graph of a ``ticks``-tick physics program."""
        if ticks not in self._programs:
            wp = self.k.wp
            actions = torch.zeros(self.num_slots, ticks, 2, dtype=torch.float32, device=self.device)
            views = {
                "state": wp.from_torch(self._state),
                "actions": wp.from_torch(actions),
                "obj": wp.from_torch(self._target_adr),
                "goal": wp.from_torch(self._goal, dtype=wp.vec2),
                "dist": wp.from_torch(self._dist, dtype=wp.vec2),
                "alive": wp.from_torch(self._alive),
                "tick": wp.from_torch(self._tick),
                "dense": wp.from_torch(self._dense),
                "sparse": wp.from_torch(self._sparse),
            }
            self._programs[ticks] = {"actions": actions, "views": views, "graph": None}
        return self._programs[ticks]

    def _launch(self, ticks: int) -> None:
        """Every tick's Warp work, eagerly, on the current Warp stream."""
        k, p = self.k, self._programs[ticks]
        v, table, n = p["views"], self.cfg.table, self.num_slots
        ring = table.ee_radius + table.obj_radius
        common = (v["state"], self._ee, v["obj"], v["goal"], ring)
        k.wp.launch(k.measure, dim=n, inputs=[*common, v["dist"]])
        for t in range(ticks):
            k.wp.launch(k.write_ctrl, dim=n, inputs=[v["state"], v["actions"], v["alive"], t, self._ctrl, self._speed])
            k.mjw.set_state(self.m, self.d, v["state"], STATE_SIG)
            for _ in range(self.cfg.frame_skip):
                k.mjw.step(self.m, self.d)
            k.mjw.get_state(self.m, self.d, v["state"], STATE_SIG, active=v["alive"])
            inputs = [*common, table.goal_radius, v["dist"], v["alive"], v["tick"], v["dense"], v["sparse"]]
            k.wp.launch(k.score, dim=n, inputs=inputs)

    def ticks_begin(self, b: BufferSet, actions: torch.Tensor) -> None:
        """Torch part before the physics: the rows, actions (slots, T, 2), each slot's target
        address and goal, alive flags and zeroed sums into the scratch Warp reads."""
        self._check(b)
        n, ticks = self.num_slots, actions.shape[1] if actions.dim() == 3 else -1
        if actions.shape != (n, ticks, 2):
            raise ValueError(f"actions must have shape ({n}, T, 2), got {tuple(actions.shape)}")
        p = self._program(ticks)
        p["actions"].copy_(actions)
        self._state.copy_(b["sim.physics"])
        target, goal = self.task.target_and_goal(b["sim.instruction"])
        self._target_adr.copy_(self._obj[target])
        self._goal.copy_(self.task.constants(self.device)["goals"][goal])
        torch.logical_not(b["sim.success"], out=self._alive)
        self._tick.copy_(b["sim.tick"])
        self._dense.zero_()
        self._sparse.zero_()

    def ticks_physics(self, ticks: int) -> None:
        """The Warp program of ``ticks`` ticks on the current torch stream: Warp's captured graph
        (captured at the first call, after one eager warm-up that compiles the kernels), or
        eager launches."""
        p, wp = self._programs[ticks], self.k.wp
        stream = None
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            if current.cuda_stream not in self._streams:  # one Warp handle per torch stream
                self._streams[current.cuda_stream] = wp.stream_from_torch(current)
            stream = self._streams[current.cuda_stream]
        with wp.ScopedDevice(self.wp_device), wp.ScopedStream(stream) if stream else contextlib.nullcontext():
            if not self.graph:
                self._launch(ticks)
                return
            if p["graph"] is None:
                saved = [t.clone() for t in self._scratch]
                self._launch(ticks)  # compile and load every module before capture, then undo it
                for t, s in zip(self._scratch, saved, strict=True):
                    t.copy_(s)
                with wp.ScopedCapture(stream=stream) as cap:
                    self._launch(ticks)
                p["graph"] = cap.graph
            wp.capture_launch(p["graph"], stream=stream)

    def ticks_end(
        self, b: BufferSet, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch part after the physics: rows, success and ticks back into the slot buffers;
        returns the summed (dense, sparse) rewards, written into ``out`` when given."""
        b["sim.physics"].copy_(self._state)
        torch.logical_not(self._alive, out=b["sim.success"])
        b["sim.tick"].copy_(self._tick)
        if out is None:
            return self._dense.clone(), self._sparse.clone()
        return out[0].copy_(self._dense), out[1].copy_(self._sparse)

    def run_ticks(
        self, b: BufferSet, actions: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance every slot ``T`` ticks under ``actions`` (slots, T, 2) in [-1, 1] (clipped);
        returns the summed (dense, sparse) rewards (into ``out`` when given). Slots that have
        succeeded stay frozen. The three parts in order, with no host synchronisation."""
        self.ticks_begin(b, actions)
        self.ticks_physics(actions.shape[1])
        return self.ticks_end(b, out)

    # -- observations (torch) ------------------------------------------------------------------
    def render(self, b: BufferSet, out: torch.Tensor | None = None) -> torch.Tensor:
        """(slots, H, W, 3) uint8 top-down images, into ``out`` when given."""
        return self.renderer(*self.poses(b), out=out)

    def observation(self, b: BufferSet) -> torch.Tensor:
        """(slots, state_dim) float32 low-dimensional observation (the tabletop's ``state``)."""
        ee, obj, _ = self.poses(b)
        return self.task.observation(ee, obj, b["sim.instruction"])

    def proprio(self, b: BufferSet) -> torch.Tensor:
        """(slots, 2) end-effector position."""
        return self.poses(b)[0]

    def expert(self, b: BufferSet) -> torch.Tensor:
        """(slots, 2) actions of the scripted pusher."""
        ee, obj, yaw = self.poses(b)
        return self.task.expert(ee, obj, yaw, b["sim.instruction"])

    def overflow(self) -> int:
        """Worlds whose contacts or constraints overflowed MuJoCo Warp's capacities so far (a
        host read: for checks between steps, never inside one)."""
        flags = getattr(self.d, "overflow", None)
        return 0 if flags is None else int((flags.numpy() != 0).sum())
