"""The push task on MuJoCo Warp: one world per slot on one GPU, an in-graph simulator.

:class:`WarpPush` implements :class:`flashrt_gym.simulator.Simulator`: its whole state is slot
buffers of the env's :class:`~flashrt.runtime.BufferSet` (``sim.physics``, MuJoCo Warp's
``get_state`` row with the integration signature, float32: time, qpos, qvel, act, the solver's
warm start, ctrl, applied forces, ...; and the task's ``sim.instruction``, ``sim.tick``,
``sim.success``, ``sim.key``, ``sim.counter``), so capsules are byte copies of them. MuJoCo
Warp's ``Data`` is scratch: each tick loads it from the rows (``set_state``), steps it
``frame_skip`` times and stores the worlds still running back (``get_state`` with the alive
mask; a world that has succeeded stays frozen).

Every program runs on the current torch stream with no host synchronisation, so the env records
the whole step (policy, ticks, autoresets, render) as one CUDA graph. What that takes of MuJoCo
Warp (``capture="torch"``, the default):

- its Warp kernels are launched on a Warp handle of the current torch stream, and a torch capture
  in progress is registered with Warp as an external capture (``wp.capture_begin(...,
  external=True)``): Warp then keeps what the recorded launches need for the graph's lifetime;
- the constraint solver runs a fixed number of iterations (``opt.graph_conditional = False``;
  each world stops updating once it has converged), since Warp's conditional while node pauses
  and resumes the capture, which a torch capture does not survive;
- the temporaries a MuJoCo Warp step allocates come from torch's caching allocator (a Warp
  allocator over it), so inside the capture they live in the graph's memory pool like any torch
  temporary, and the recorded graph holds no memory nodes (which CUDA refuses in the conditional
  body the env's guarded step is);
- run-to-run determinism (``opt.deterministic``): without it, floating-point atomics make two
  runs of the same step differ in the last bits, and a restored capsule would not continue
  byte for byte. With MuJoCo Warp 4.0.0 it holds at few worlds only: its contact and constraint
  sorts are placeholders, so with many worlds a world's contact order follows the atomics
  (measured in docs/PERFORMANCE.md). Its records of the atomics (Warp's deterministic mode sorts
  them after each launch) are most of the memory Warp holds, and a launch may keep at most
  :data:`DETERMINISTIC_RECORDS` of them, which bounds the world count.

``capture="warp"`` instead runs the ticks' physics as Warp's own captured graph, with the
solver's conditional loop (``opt.graph_conditional = True``: it stops when every world has
converged, where the fixed bound runs all its iterations). It cannot be recorded into a torch
capture, so the env's step becomes three launches on one stream
(:class:`flashrt_gym.simulator.SplitTicks`): the policy's graph ending with :meth:`WarpPush.begin_ticks`,
Warp's graph (:meth:`WarpPush.physics`), and a graph starting with :meth:`WarpPush.end_ticks`
(rewards, autoreset, render, encode). The state is the same ``sim.*`` rows, so capsules are the
same byte copies.

``warp`` and ``mujoco_warp`` are imported when a :class:`WarpPush` is bound, never by
``import flashrt_gym.sims``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import mujoco
import numpy as np
import torch

from flashrt.runtime import BufferSet, BufferSpec, collector_paused, slot
from flashrt.runtime.views import bind_views
from flashrt_gym.assets import TINY_MUJOCO
from flashrt_gym.sims.push.mujoco_cpu import renderer_for
from flashrt_gym.sims.push.task import (
    PushConfig,
    PushTask,
    as_push_config,
    cameras_identity,
    load_scene,
    model_digest,
    yaw_of,
)
from flashrt_gym.sims.push.warp_api import KeptAllocator, TorchAllocator, warp_api
from flashrt_gym.simulator import BoundState

STATE_SIG = int(mujoco.mjtState.mjSTATE_INTEGRATION)
DETERMINISTIC_RECORDS = 2**31 - 1
"""The most records of atomics one launch may keep in Warp's deterministic mode (Warp 1.19's
``DETERMINISTIC_SCATTER_MAX_CAPACITY``: int32 offsets): a launch over ``d`` threads that may
each update ``r`` targets needs ``d * r``, so the deterministic mode has a world-count limit."""
ITERATIONS = 10
"""Default bound of the constraint solver's iterations per physics step (MuJoCo's C library,
unbounded at 100, needs at most 11 and 1.1 on average on this task's expert episodes)."""


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


@dataclass(frozen=True)
class WarpPushState:
    """Typed views of the simulator's ``sim.*`` slot buffers (each ``(slots, ...)``)."""

    physics: torch.Tensor  # (nstate,) float32 MuJoCo Warp's integration state row
    instruction: torch.Tensor  # () int64 index into WarpPush.instructions
    tick: torch.Tensor  # () int64 ticks into the episode (frozen after success)
    success: torch.Tensor  # () bool
    key: torch.Tensor  # () int64 the slot's RNG stream
    counter: torch.Tensor  # () int64 draws taken from it (one per episode)


class WarpPush(BoundState):
    """The batched push simulator on MuJoCo Warp, an in-graph simulator.

    Make it, put :meth:`specs` into the set's specs, then :meth:`bind` it to the set (which
    builds MuJoCo Warp's model and data on the set's device).

    Args:
        num_slots: worlds (parallel episodes); the buffer set must have this many slots.
        cfg: the task's parameters, or a mapping of them.
        capture: ``"torch"`` (the ticks are recorded into the caller's torch graph) or
            ``"warp"`` (the ticks' physics replays Warp's own graph with the solver's conditional
            loop, between the env step's two captured parts; never inside a torch capture).
        iterations: constraint solver iterations at most per physics step (MuJoCo's default is
            100; a fixed count is recorded into the graph, so this bounds the graph's size).
        deterministic: MuJoCo Warp's run-to-run determinism (needed for byte-exact restores; with
            MuJoCo Warp 4.0.0 they are byte-exact at few worlds only, see the module).
        nconmax, njmax: MuJoCo Warp's contact and constraint capacities per world.
        loop: with ``capture="warp"``, the ticks and their physics steps as two nested while
            loops of Warp's graph around one recorded ``mjw.step`` (one copy of the step and its
            scratch in the graph) instead of ``ticks * frame_skip`` copies; the same kernels in
            the same order.
    """

    action_dim = 2
    proprio_dim = 2
    observation_bound = 1.0
    pretrained_weights = TINY_MUJOCO
    """The policy the env loads when it is given no weights: the tiny VLA trained on this task."""

    def __init__(
        self,
        num_slots: int,
        cfg: PushConfig | Mapping[str, Any] | None = None,
        *,
        capture: Literal["torch", "warp"] = "torch",
        iterations: int = ITERATIONS,
        deterministic: bool = True,
        nconmax: int = 32,
        njmax: int = 160,
        loop: bool = False,
    ) -> None:
        if isinstance(num_slots, bool) or int(num_slots) < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if capture not in ("torch", "warp"):
            raise ValueError(f"capture must be 'torch' or 'warp', got {capture!r}")
        if loop and capture != "warp":
            raise ValueError("loop=True needs capture='warp': a torch capture cannot record Warp's while loops")
        for name, value in (("iterations", iterations), ("nconmax", nconmax), ("njmax", njmax)):
            if isinstance(value, bool) or int(value) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.cfg = cfg = as_push_config(cfg)
        self.num_slots = int(num_slots)
        self.capture, self.loop = capture, bool(loop)
        self.iterations, self.deterministic = int(iterations), bool(deterministic)
        self.nconmax, self.njmax = int(nconmax), int(njmax)
        self.mjm, self.layout = load_scene(cfg)
        self.mjm.opt.iterations = min(self.mjm.opt.iterations, self.iterations)
        self.task = PushTask(cfg, self.layout)
        self.instructions = self.task.instructions
        self.image_size = cfg.table.image_size
        self.num_cameras = len(cfg.cameras)
        self.observation_dim = self.task.observation_dim
        self.nstate = mujoco.mj_stateSize(self.mjm, STATE_SIG)
        off = state_offsets(self.mjm)
        lay = self.layout
        if lay.ee_qpos[1] != lay.ee_qpos[0] + 1 or list(lay.ee_actuators) != [0, 1]:
            raise ValueError("the scene must declare ee_x then ee_y, and their two actuators first")
        self._ee, self._ctrl = off["qpos"] + lay.ee_qpos[0], off["ctrl"]
        self._obj = [off["qpos"] + a for a in lay.obj_qpos]
        self._speed = cfg.table.max_speed / lay.tick_seconds
        self._digest = model_digest(self.mjm)
        self.renderer = renderer_for(cfg, self.task)
        self._state: WarpPushState | None = None
        self._programs: dict[int, dict[str, Any]] = {}
        self._streams: dict[int, Any] = {}
        self._side: torch.cuda.Stream | None = None  # where Warp's own graph runs (capture="warp")
        self._captures: list[Any] = []  # Warp's records of the torch captures the ticks joined

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

    def bind(self, bufs: BufferSet) -> WarpPush:
        """Take the ``sim.*`` buffers of ``bufs`` (once) and build MuJoCo Warp's model, data and
        the scratch of the ticks on its device."""
        if self._state is not None:
            raise ValueError("this WarpPush is bound to a buffer set already; make one per set")
        if bufs.num_slots != self.num_slots:
            raise ValueError(
                f"this simulator runs {self.num_slots} worlds; the buffer set has {bufs.num_slots} slots: make the "
                "simulator with the env's num_envs"
            )
        k = warp_api()
        state = bind_views(WarpPushState, bufs, "sim")
        device = self.device = state.physics.device
        self.wp_device = k.wp.device_from_torch(device)
        n = self.num_slots
        with k.wp.ScopedDevice(self.wp_device):
            self.m = k.mjw.put_model(self.mjm)
            # capture="torch": a fixed iteration bound (no conditional node, see the module); "warp": the
            # solver's conditional loop, which stops when every world has converged
            self.m.opt.graph_conditional = self.capture == "warp"
            self.m.opt.deterministic = int(k.mjw.DeterminismType.ALL if self.deterministic else 0)
            # The bound is this simulator's setting, not a fault: a world that stops at it is flagged
            # (overflow()) without a kernel printf each physics step.
            bound = int(k.mjw.OverflowType.ITERATIONS | k.mjw.OverflowType.LS_ITERATIONS)
            self.m.opt.warn_overflow = int(self.m.opt.warn_overflow) & ~bound
            self.d = k.mjw.make_data(self.mjm, nworld=n, nconmax=self.nconmax, njmax=self.njmax)
        cold = mujoco.MjData(self.mjm)
        row = np.empty(self.nstate)
        mujoco.mj_getState(self.mjm, cold, row, STATE_SIG)
        self._cold = torch.tensor(row, dtype=torch.float32, device=device)
        f32 = {"dtype": torch.float32, "device": device}
        self._rows = torch.zeros(n, self.nstate, **f32)  # what Warp loads and stores
        self._obj_adr = torch.tensor(self._obj, dtype=torch.int32, device=device)
        self._target_adr = torch.zeros(n, dtype=torch.int32, device=device)
        self._goal = torch.zeros(n, 2, **f32)
        self._dist = torch.zeros(n, 2, **f32)
        self._alive = torch.zeros(n, dtype=torch.bool, device=device)
        self._tick = torch.zeros(n, dtype=torch.int64, device=device)
        self._dense = torch.zeros(n, **f32)
        self._sparse = torch.zeros(n, **f32)
        self._scratch = (self._rows, self._dist, self._alive, self._tick, self._dense, self._sparse)
        self.task.constants(device)
        self.renderer.constants(device)
        use_torch = device.type == "cuda" and self.capture == "torch"
        self._allocator = TorchAllocator(device, self.wp_device.current_allocator) if use_torch else None
        self._state = state
        return self

    def identity(self) -> str:
        """The compiled model, the task's parameters and the solver settings that change results."""
        return (
            f"mujoco-warp-push|model={self._digest}|{sorted(self.cfg.table.to_dict().items())}|"
            f"frame_skip={self.cfg.frame_skip}|iterations={self.iterations}|deterministic={self.deterministic}|"
            f"nconmax={self.nconmax}|njmax={self.njmax}{cameras_identity(self.cfg)}"
        )

    def validate(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` naming the buffer if ``sim.*`` tensors (a capsule's, before it is
        restored) hold values this simulator cannot step from."""
        instr = state["sim.instruction"]
        if instr.numel() and (int(instr.min()) < 0 or int(instr.max()) >= len(self.instructions)):
            raise ValueError(f"sim.instruction holds indices outside [0, {len(self.instructions)})")
        for name in ("sim.tick", "sim.counter"):
            if state[name].numel() and int(state[name].min()) < 0:
                raise ValueError(f"{name} holds negative values")
        if not torch.isfinite(state["sim.physics"]).all():
            raise ValueError("sim.physics holds NaN or infinity")
        success = state["sim.success"]
        if success.numel() and int(success.view(torch.uint8).max()) > 1:
            raise ValueError("sim.success holds bytes other than 0 and 1")

    def poses(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, 2) end-effector, (slots, K, 2) object positions and (slots, K) headings."""
        phys = self.state.physics
        obj = torch.stack([phys[:, a : a + 7] for a in self._obj], dim=1)  # x y z qw qx qy qz
        return phys[:, self._ee : self._ee + 2], obj[..., :2], yaw_of(obj[..., 3:7])

    # -- episodes (torch) ----------------------------------------------------------------------
    def seed(self, seeds: torch.Tensor) -> None:
        """Give every slot the RNG stream of its int64 seed (slots,), from its first draw."""
        s = self.state
        s.key.copy_(seeds)
        s.counter.zero_()

    def reset(self, mask: torch.Tensor | None = None, instruction: torch.Tensor | None = None) -> None:
        """Draw the next episode of each slot's stream where ``mask`` (all if None): the
        tabletop's draws into a cold state row (zero velocity and warm start, objects upright).
        ``instruction`` (slots,) forces instruction indices where >= 0. Capturable."""
        s = self.state
        m = torch.ones_like(s.success) if mask is None else mask
        drawn, ee, obj = self.task.draw(s.key, s.counter, instruction)
        rows = self._cold.expand(self.num_slots, -1).clone()
        rows[:, self._ee : self._ee + 2] = ee
        for k, a in enumerate(self._obj):
            rows[:, a : a + 2] = obj[:, k]
        s.physics.copy_(torch.where(m[:, None], rows, s.physics))
        s.instruction.copy_(torch.where(m, drawn, s.instruction))
        s.tick.masked_fill_(m, 0)
        s.success.masked_fill_(m, False)
        s.counter.add_(m.long())

    # -- the ticks -----------------------------------------------------------------------------
    def _program(self, ticks: int) -> dict[str, Any]:
        """The actions scratch and Warp's views of a ``ticks``-tick program (made once per T)."""
        if ticks not in self._programs:
            wp = warp_api().wp
            actions = torch.zeros(self.num_slots, ticks, 2, dtype=torch.float32, device=self.device)
            views = {
                "rows": wp.from_torch(self._rows),
                "actions": wp.from_torch(actions),
                "obj": wp.from_torch(self._target_adr),
                "goal": wp.from_torch(self._goal, dtype=wp.vec2),
                "dist": wp.from_torch(self._dist, dtype=wp.vec2),
                "alive": wp.from_torch(self._alive),
                "tick": wp.from_torch(self._tick),
                "dense": wp.from_torch(self._dense),
                "sparse": wp.from_torch(self._sparse),
            }
            counters = {
                name: wp.zeros(1, dtype=wp.int32, device=self.wp_device) for name in ("ticks_left", "steps_left")
            }
            self._programs[ticks] = {"actions": actions, "views": views, "graph": None, **counters}
        return self._programs[ticks]

    def _launch(self, ticks: int) -> None:
        """Every tick's Warp work (control, load, steps, store, rewards), on Warp's current stream:
        unrolled, or with ``loop`` as two nested while loops around one tick and one physics step.

        Raises:
            RuntimeError: with ``deterministic``, a MuJoCo Warp launch needs more records of its
                atomics than Warp's deterministic mode can hold (too many worlds); names the fix.
        """
        try:
            self._launch_ticks(ticks)
        except warp_api().wp.WarpDeterminismError as e:
            raise RuntimeError(
                f"WarpPush of {self.num_slots} worlds, deterministic={self.deterministic}: MuJoCo Warp's "
                "deterministic mode keeps a record of every floating-point atomic of a launch, sorted after it, "
                f"and Warp holds at most {DETERMINISTIC_RECORDS} records a launch; a launch at this many worlds "
                f"needs more ({e}). Use fewer worlds a simulator, or deterministic=False (Hydra: "
                "task.deterministic=false), which keeps no records (with MuJoCo Warp 4.0.0 it is no less exact at "
                "many worlds: see WarpPush's module docstring)"
            ) from e

    def _launch_ticks(self, ticks: int) -> None:
        """:meth:`_launch`'s body."""
        k, p = warp_api(), self._programs[ticks]
        v, table, n = p["views"], self.cfg.table, self.num_slots
        ring = table.ee_radius + table.obj_radius
        common = (v["rows"], self._ee, v["obj"], v["goal"], ring)
        k.wp.launch(k.measure, dim=n, inputs=[*common, v["dist"]])
        scored = [*common, table.goal_radius, v["dist"], v["alive"], v["tick"], v["dense"], v["sparse"]]
        if self.loop:
            self._launch_looped(ticks, scored)
            return
        for t in range(ticks):
            k.wp.launch(k.write_ctrl, dim=n, inputs=[v["rows"], v["actions"], v["alive"], t, self._ctrl, self._speed])
            k.mjw.set_state(self.m, self.d, v["rows"], STATE_SIG)
            for _ in range(self.cfg.frame_skip):
                k.mjw.step(self.m, self.d)
            k.mjw.get_state(self.m, self.d, v["rows"], STATE_SIG, active=v["alive"])
            k.wp.launch(k.score, dim=n, inputs=scored)

    def _launch_looped(self, ticks: int, scored: list) -> None:
        """The ticks as a while loop over one tick, whose physics is a while loop over one
        ``mjw.step``: in a captured graph, one recorded copy of the step (and of its scratch)
        instead of ``ticks * frame_skip``. The counters live on the device. ``scored``: the
        ``score`` kernel's inputs."""
        k, p = warp_api(), self._programs[ticks]
        wp, v, n = k.wp, p["views"], self.num_slots
        ticks_left, steps_left = p["ticks_left"], p["steps_left"]

        def one_step() -> None:
            k.mjw.step(self.m, self.d)
            wp.launch(k.count_down, dim=1, inputs=[steps_left])

        def one_tick() -> None:
            wp.launch(k.write_ctrl_left, dim=n, inputs=[v["rows"], v["actions"], v["alive"], ticks_left, ticks,
                                                        self._ctrl, self._speed])  # fmt: skip
            k.mjw.set_state(self.m, self.d, v["rows"], STATE_SIG)
            wp.launch(k.set_count, dim=1, inputs=[steps_left, self.cfg.frame_skip])
            wp.capture_while(steps_left, one_step)
            k.mjw.get_state(self.m, self.d, v["rows"], STATE_SIG, active=v["alive"])
            wp.launch(k.score, dim=n, inputs=scored)
            wp.launch(k.count_down, dim=1, inputs=[ticks_left])

        wp.launch(k.set_count, dim=1, inputs=[ticks_left, ticks])
        wp.capture_while(ticks_left, one_tick)

    def _stream(self) -> Any:
        """Warp's handle of the current torch stream."""
        return self._stream_of(torch.cuda.current_stream(self.device))

    def _stream_of(self, stream: torch.cuda.Stream) -> Any:
        """Warp's handle of the torch ``stream`` (one per torch stream, made once)."""
        if stream.cuda_stream not in self._streams:
            self._streams[stream.cuda_stream] = warp_api().wp.stream_from_torch(stream)
        return self._streams[stream.cuda_stream]

    def physics(self, ticks: int) -> None:
        """The Warp part of :meth:`run_ticks` over the scratch that :meth:`run_ticks` fills,
        on the current torch stream: recorded into a torch capture in progress
        (``capture="torch"``), or Warp's own graph replayed (``capture="warp"``, captured at the
        first call after one eager run that loads the kernels)."""
        k, p = warp_api(), self._program(ticks)
        wp = k.wp
        if self.device.type != "cuda":  # Warp's CPU backend: eager launches
            with wp.ScopedDevice(self.wp_device):
                self._launch(ticks)
            return
        stream = self._stream()
        capturing = torch.cuda.is_current_stream_capturing()
        with wp.ScopedDevice(self.wp_device), wp.ScopedStream(stream, sync_enter=False):
            if self.capture == "warp":
                if capturing:
                    raise RuntimeError(
                        "WarpPush(capture='warp') replays its own graph and cannot be recorded into a torch "
                        "capture; use capture='torch' in a captured env step"
                    )
                self._replay_own_graph(p, ticks)
                return
            self._allocator.stream = stream
            with wp.ScopedAllocator(self.wp_device, self._allocator):
                if capturing:
                    wp.capture_begin(stream=stream, external=True)
                try:
                    self._launch(ticks)
                finally:
                    if capturing:
                        self._captures.append(wp.capture_end(stream=stream))

    def _replay_own_graph(self, p: dict[str, Any], ticks: int) -> None:
        """``capture="warp"``: Warp's graph of the ticks, captured at the first call (after one
        eager run that loads the modules, then undone) and replayed on a side stream that this
        simulator owns, ordered after the torch stream's work and before its next. CUDA cannot
        capture the legacy default stream, which is torch's current stream in an eager env."""
        wp, current = warp_api().wp, torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side, on_side = self._side, self._stream_of(self._side)
        if p["graph"] is None:
            saved = [t.clone() for t in self._scratch]
            self._launch(ticks)  # on the torch stream
            for t, s in zip(self._scratch, saved, strict=True):
                t.copy_(s)
            # looped: the body's allocations are kept with the program (no memory nodes in a while body)
            kept = KeptAllocator(self.device) if self.loop else None
            with contextlib.ExitStack() as scope:
                scope.enter_context(wp.ScopedStream(on_side, sync_enter=False))
                scope.enter_context(collector_paused())
                cap = scope.enter_context(wp.ScopedCapture(stream=on_side))
                if kept is not None:
                    scope.enter_context(kept.serving(side))
                    scope.enter_context(wp.ScopedAllocator(self.wp_device, kept))
                self._launch(ticks)
            p["graph"], p["kept"] = cap.graph, kept
        side.wait_stream(current)
        wp.capture_launch(p["graph"], stream=on_side)
        current.wait_stream(side)

    def run_ticks(self, actions: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """Advance every slot ``T`` ticks under ``actions (slots, T, 2)`` in [-1, 1] (clipped)
        and write the summed (dense, sparse) rewards into ``dense`` and ``sparse`` (float32
        (slots,)). Slots that have succeeded stay frozen and earn nothing. Torch, then Warp,
        then torch (:meth:`begin_ticks`, :meth:`physics`, :meth:`end_ticks`), on the current
        stream with no host synchronisation: capturable with ``capture="torch"``."""
        self.begin_ticks(actions, dense, sparse)
        self.physics(actions.shape[1])
        self.end_ticks(dense, sparse)

    @property
    def physics_outside_capture(self) -> bool:
        """``capture="warp"``: the env's step runs :meth:`physics` as Warp's own graph between its
        two captured parts (:class:`flashrt_gym.simulator.SplitTicks`)."""
        return self.capture == "warp"

    def begin_ticks(self, actions: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """The torch part of :meth:`run_ticks` before the physics: the slots' rows, targets,
        goals and flags into the ticks' scratch. Capturable."""
        s, n = self.state, self.num_slots
        if actions.dim() != 3 or actions.shape[0] != n or actions.shape[2] != self.action_dim:
            raise ValueError(f"run_ticks: actions must be ({n}, T, {self.action_dim}), got {tuple(actions.shape)}")
        if any(o.shape != (n,) or o.dtype != torch.float32 for o in (dense, sparse)):
            raise ValueError(f"run_ticks: dense and sparse must be float32 ({n},) tensors")
        p = self._program(actions.shape[1])
        p["actions"].copy_(actions)
        self._rows.copy_(s.physics)
        target, goal = self.task.target_and_goal(s.instruction)
        self._target_adr.copy_(self._obj_adr[target])
        self._goal.copy_(self.task.constants(self.device)["goals"][goal])
        torch.logical_not(s.success, out=self._alive)
        self._tick.copy_(s.tick)
        self._dense.zero_()
        self._sparse.zero_()

    def end_ticks(self, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """The torch part of :meth:`run_ticks` after the physics: the stepped rows, flags, tick
        counters and rewards back into the slots' buffers and ``dense``/``sparse``. Capturable."""
        s = self.state
        s.physics.copy_(self._rows)
        torch.logical_not(self._alive, out=s.success)
        s.tick.copy_(self._tick)
        dense.copy_(self._dense)
        sparse.copy_(self._sparse)

    # -- observations (torch, capturable) ------------------------------------------------------
    def render(self, out: torch.Tensor) -> None:
        """Every slot's top-down images into ``out (slots, num_cameras, H, W, 3)`` uint8."""
        self.renderer(*self.poses(), out=out)

    def proprio(self, out: torch.Tensor) -> None:
        """(slots, 2) end-effector position into ``out``."""
        out.copy_(self.poses()[0])

    def observation(self, out: torch.Tensor) -> None:
        """(slots, observation_dim) float32 low-dimensional observation into ``out``."""
        ee, obj, _ = self.poses()
        out.copy_(self.task.observation(ee, obj, self.state.instruction))

    def expert(self) -> torch.Tensor:
        """(slots, 2) actions of the scripted pusher (not capturable: for scripts)."""
        ee, obj, yaw = self.poses()
        return self.task.expert(ee, obj, yaw, self.state.instruction)

    def overflow(self) -> dict[str, int]:
        """The worlds MuJoCo Warp has flagged so far, by kind (a host read: for checks between
        steps, never inside one). ``capacity``: contacts, constraints or collision buffers
        overflowed, so the physics dropped some (raise ``nconmax`` / ``njmax``).
        ``solver_iterations``: the constraint solver or its line search stopped at its iteration
        bound (``iterations``) before its tolerance, as MuJoCo's C library also does."""
        flags = getattr(self.d, "overflow", None)
        if flags is None:
            return {"capacity": 0, "solver_iterations": 0}
        kind = warp_api().mjw.OverflowType
        bound = int(kind.ITERATIONS | kind.LS_ITERATIONS)
        f = flags.numpy()
        return {"capacity": int(((f & ~bound) != 0).sum()), "solver_iterations": int(((f & bound) != 0).sum())}
