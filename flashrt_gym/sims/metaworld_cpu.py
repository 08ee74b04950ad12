"""Meta-World on MuJoCo's C library: one Meta-World task instance per slot, on the CPU.

An :class:`~flashrt_gym.simulator.ExternalSimulator` over Meta-World 3's own scenes, rewards and
success rule (``info["success"]``). Slot ``i`` hosts task ``(i // block) % len(tasks)``; each
episode draws its object and goal positions from the slot's seeded stream (Meta-World's
``seeded_rand_vec`` mode: uniform over the task's reset space, the goal visible in the
observation as in the MT benchmarks), where the published MT1 / MT10 protocol cycles through 50
fixed draws per task.

The slots of a task share one MuJoCo model in each thread that steps them (a Meta-World model is
about 19 MB): each slot's episode rows of it (:func:`~flashrt_gym.sims.metaworld_state.episode_model_fields`:
the fixtures and goal marker its resets move) are kept apart and written into the model before the
slot is touched, and read back after, so every slot runs as on a model of its own.

A slot's state row holds everything its next step and reset read (see
:mod:`flashrt_gym.sims.metaworld_state`): MuJoCo's integration state, the model rows the task
writes per episode, the instance's Python fields (its reset RNG included) and this wrapper's own
(instruction, success, stream key, last observation), with a SHA-256 of the row at its end, so a
corrupted or foreign row is refused before any slot changes. A row restores only into a slot of
its own task (a row carries its task's model layout).
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

if sys.platform.startswith("linux"):  # MuJoCo picks its OpenGL backend when it is first imported
    os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco
import numpy as np

from flashrt_gym.assets import TINY_METAWORLD
from flashrt_gym.sims.metaworld_state import (
    Views,
    dump_fields,
    episode_model_fields,
    load_fields,
    model_rows,
    reset_mocap_welds,
    write_fields,
    write_model_rows,
)
from flashrt_gym.sims.metaworld_tasks import INSTRUCTIONS, task_names

try:
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS, ML1_ARGS_KWARGS
    from metaworld.policies import ENV_POLICY_MAP
except ImportError as e:  # pragma: no cover - exercised only where metaworld is missing
    raise ImportError(
        f"Meta-World is not installed ({e}); run `bash scripts/install_metaworld.sh` (it pins around "
        "metaworld's mujoco==3.3.0 requirement, see README's Meta-World section)"
    ) from e

STATE_SIG = int(mujoco.mjtState.mjSTATE_INTEGRATION)
"""The ``mj_getState`` signature a row's physics holds."""

HEAD = ("tag", "task", "instruction", "success", "key", "fields_len")
"""A row's leading int64 fields: the layout's tag, the task index, the instruction index, the
success flag, the stream key, the byte length of the encoded Python fields."""

OBS_DIM = 39
"""Meta-World's observation: hand (3), gripper (1), objects (14), the same of the previous tick, goal (3)."""

OVERVIEW = {"lookat": (0.0, 0.72, 0.15), "azimuth": -135.0, "elevation": -50.0, "distance": 1.0}
"""The ``"overview"`` camera: a free camera above the table's front-left corner that keeps the
gripper, the object, its handle and the goal in view in the MT10 tasks at 64 px, whole doors and
windows included (chosen on rendered frames of several draws; the scenes' ``corner`` cameras
render upside down and from further away, the front views hide the gripper behind doors, drawers
and windows, a closer view cuts the windows off)."""


def _uint64(key: int) -> int:
    return int(np.int64(key).view(np.uint64))


def _host(x: Any) -> np.ndarray:
    return np.asarray(x.cpu() if hasattr(x, "cpu") else x)


class MetaWorld:
    """Meta-World tasks on the CPU, an external simulator: slot ``i`` a task instance of
    ``tasks[(i // block) % len(tasks)]``.

    Args:
        num_slots: parallel episodes.
        tasks: ``"MT10"``, one Meta-World task name, or a list of them (the instruction indices).
        threads: CPU threads that step and reset the slots (MuJoCo releases the GIL while it steps;
            each slot is its own instance, so the results are the same bytes for any count).
        image_size: the camera's square resolution (the policy's).
        camera: ``"overview"`` (:data:`OVERVIEW`) or a camera of the scene (``"corner"``, ...; a camera
            whose up axis points down is turned the right way up).
        block: slots come in runs of ``block`` of one task: slot ``i`` runs task
            ``(i // block) % len(tasks)``. Rows fork only between slots of one task, so a search
            that forks a slot into its next ``k - 1`` neighbours (``scripts/steer_search.py``'s
            groups) wants ``block=k``.
        first_slot: the simulator's slot 0 is slot ``first_slot`` of a larger one, for the task
            rule above (a shard of :class:`~flashrt_gym.sims.processes.Processes`).

    Raises:
        ValueError: bad arguments, named.
    """

    num_cameras = 1
    action_dim = 4
    proprio_dim = 4
    observation_dim = OBS_DIM
    observation_bound = None
    physics_signature = STATE_SIG

    def __init__(
        self,
        num_slots: int,
        tasks: str | Sequence[str] = "MT10",
        threads: int = 1,
        image_size: int = 64,
        camera: str = "overview",
        block: int = 1,
        first_slot: int = 0,
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1 (e.g. os.cpu_count()), got {threads!r}")
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
            raise ValueError(f"image_size must be an int >= 8, got {image_size!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an int >= 1 (slots in a run of one task), got {block!r}")
        if isinstance(first_slot, bool) or not isinstance(first_slot, int) or first_slot < 0:
            raise ValueError(f"first_slot must be an int >= 0, got {first_slot!r}")
        self.task_names = task_names(tasks)
        self.instructions = [INSTRUCTIONS[n] for n in self.task_names]
        self.num_slots, self.threads, self.image_size, self.camera = num_slots, threads, image_size, camera
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="metaworld") if threads > 1 else None
        shim = {"reset_mocap_welds": reset_mocap_welds, "_shared_model": None,
                "_initialize_simulation": _initialize_simulation}  # fmt: skip
        self._classes = {n: type(c.__name__, (c,), dict(shim)) for n, c in
                         ((n, ALL_V3_ENVIRONMENTS[n]) for n in self.task_names)}  # fmt: skip
        self.model_fields: dict[str, tuple[str, ...]] = {}
        """Per task, the model arrays its resets write (:func:`episode_model_fields`)."""
        self.physics_size, self.model_bytes = [], []  # per task: float64s of physics, bytes of model rows
        seen = 0  # the longest encoded Python fields over the discovery's episodes
        for name in self.task_names:
            env = self.make_instance(name)
            self.model_fields[name] = fields = episode_model_fields(env, _episode)
            self.physics_size.append(mujoco.mj_stateSize(env.model, STATE_SIG))
            self.model_bytes.append(len(model_rows(env.model, fields)))
            seen = max(seen, len(dump_fields(env, Views(env))))
            env.close()
        self.fields_capacity = -(-(2 * seen + 1024) // 8) * 8
        """Bytes a row keeps for the encoded Python fields: twice the longest seen, and 1 KiB."""
        self.task = ((np.arange(num_slots) + first_slot) // block) % len(self.task_names)
        self.envs, built = [], {}  # built: each task's model rows as compiled (a fresh instance's)
        for t in self.task:
            name = self.task_names[t]
            self.envs.append(self.make_instance(name))
            cls = self._classes[name]
            if cls._shared_model is None:  # the task's first slot compiled the model its others share
                cls._shared_model = self.envs[-1].model
                built[name] = model_rows(cls._shared_model, self.model_fields[name])
        self._rows = [built[self.task_names[t]] for t in self.task]
        """Each slot's episode rows of its task's model (:attr:`model_fields`), kept apart."""
        self._lock = threading.Lock()
        self._models: dict[tuple[int, int], mujoco.MjModel] = {}
        """(task, thread) -> the model that thread steps the task's slots with (the shared one for
        the first thread to ask, a copy for the others)."""
        if camera != "overview" and mujoco.mj_name2id(self.envs[0].model, mujoco.mjtObj.mjOBJ_CAMERA, camera) < 0:
            raise ValueError(f"camera must be 'overview' or a camera of the scene, got {camera!r}")
        self._views = [Views(e) for e in self.envs]
        self._vars = np.zeros((num_slots, len(HEAD)), dtype=np.int64)
        self._obs = np.zeros((num_slots, OBS_DIM), dtype=np.float64)
        self._experts = {n: ENV_POLICY_MAP[n]() for n in self.task_names}
        self._head_bytes = 8 * (len(HEAD) + OBS_DIM)
        self._physics_at = self._head_bytes + self.fields_capacity
        body = max(8 * p + m for p, m in zip(self.physics_size, self.model_bytes, strict=True))
        self.state_nbytes = -(-(self._physics_at + body) // 8) * 8 + 32
        self._tag = int.from_bytes(hashlib.sha256(self.identity().encode()).digest()[:8], "little", signed=True)
        self._vars[:, HEAD.index("tag")] = self._tag
        self._vars[:, HEAD.index("task")] = self.task
        self._vars[:, HEAD.index("instruction")] = self.task
        for i in range(num_slots):
            env = self._load(i)
            mujoco.mj_forward(env.model, env.data)

    def _load(self, i: int) -> Any:
        """Slot ``i``'s instance, its episode rows written into the model this thread steps its task
        with (the slots of a task share it: nothing of another slot's episode stays)."""
        t = int(self.task[i])
        key = (t, threading.get_ident())
        model = self._models.get(key)
        if model is None:
            with self._lock:  # two threads meeting the task at once must not both take the shared model
                shared = self._classes[self.task_names[t]]._shared_model
                first = not any(k[0] == t for k in self._models)
                model = self._models.setdefault(key, shared if first else copy.deepcopy(shared))
        write_model_rows(model, self.model_fields[self.task_names[t]], self._rows[i])
        env = self.envs[i]
        env.model = model
        return env

    def _keep(self, i: int) -> None:
        """Read slot ``i``'s episode rows back from its model (a reset or a step may write them)."""
        self._rows[i] = model_rows(self.envs[i].model, self.model_fields[self.task_names[int(self.task[i])]])

    def make_instance(self, name: str) -> Any:
        """A fresh Meta-World instance of task ``name`` as this simulator runs it: its task set
        as Meta-World's benchmarks set it, each reset drawing from ``np_random``, the goal in the
        observation (the MT benchmarks' setting)."""
        env = self._classes[name]()
        kwargs = {k: v for k, v in ML1_ARGS_KWARGS[name]["kwargs"].items() if k != "task_id"}
        env._set_task_inner(**kwargs)
        env._set_task_called, env._freeze_rand_vec, env.seeded_rand_vec = True, False, True
        env._partially_observable = False
        vars(env).pop("sawyer_observation_space", None)  # a cached property of the observability
        return env

    @property
    def pretrained_weights(self) -> Path | None:
        """The policy the env loads when it is given no weights: the tiny VLA cloned on MT10 where
        every task is one of MT10's, else None (no shipped policy knows the others' instructions)."""
        return TINY_METAWORLD if set(self.task_names) <= set(task_names("MT10")) else None

    def identity(self) -> str:
        """Meta-World's and MuJoCo's versions, the tasks, the camera and the row layout."""
        fields = [self.model_fields[n] for n in self.task_names]
        return (
            f"metaworld={version('metaworld')}|mujoco={mujoco.__version__}|"
            f"tasks={list(self.task_names)}|image={self.image_size}|camera={self.camera}|model_rows={fields}|"
            f"fields={self.fields_capacity}|signature={STATE_SIG}"
        )

    # -- wrapper fields ------------------------------------------------------------------------
    def _field(self, name: str) -> np.ndarray:
        return self._vars[:, HEAD.index(name)]

    def instruction(self) -> np.ndarray:
        """(slots,) int64 index into :attr:`instructions` (a copy)."""
        return self._field("instruction").copy()

    def success(self) -> np.ndarray:
        """(slots,) bool: Meta-World's ``info["success"]`` has been 1 this episode (the slot is frozen)."""
        return self._field("success") != 0

    def ticks(self) -> np.ndarray:
        """(slots,) int64 ticks of the current episode (Meta-World's ``curr_path_length``)."""
        return np.array([e.curr_path_length for e in self.envs], dtype=np.int64)

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
        if s.size and (s.min() < 0 or s.max() >= self.num_slots or len(set(s.tolist())) != s.size):
            raise ValueError(f"slot indices must be distinct and lie in [0, {self.num_slots}), got {s.tolist()}")
        return s

    def _map(self, work: Any, slots: np.ndarray) -> None:
        """``work(part)`` over ``slots``, split across the threads."""
        if self._pool is None or len(slots) < 2:
            work(slots)
        else:
            list(self._pool.map(work, np.array_split(slots, min(self.threads, len(slots)))))

    # -- episodes ------------------------------------------------------------------------------
    def seed(self, seeds: Any, slots: Any = None) -> None:
        """Restart the stream of each slot (all, or ``slots``) from its int64 seed: the slot's
        task instance draws its next episodes from ``PCG64(seed)``."""
        s = self._slots(slots)
        k = _host(seeds)
        if k.shape != (s.size,) or (k.size and k.dtype.kind not in "iu"):
            raise ValueError(f"seeds must be {s.size} integers, one per slot, got {k.dtype} {k.shape}")
        for i, key in zip(s, k.astype(np.int64), strict=True):
            self.envs[i].np_random = np.random.Generator(np.random.PCG64(_uint64(key)))
        self._field("key")[s] = k

    def reset(self, mask: Any = None) -> None:
        """Draw the next episode of each masked slot (all if None): Meta-World's ``reset``."""
        m = self._mask(mask)

        def work(part: np.ndarray) -> None:
            for i in part:
                env = self._load(i)
                self._obs[i] = env.reset()[0]
                mujoco.mj_forward(env.model, env.data)
                self._keep(i)

        self._map(work, np.flatnonzero(m))
        self._field("instruction")[m] = self.task[m]
        self._field("success")[m] = 0

    def set_instruction(self, index: int, slots: Any = None) -> None:
        """Give ``slots`` (all if None) the instruction ``index`` from the next tick on (the scene
        and its success rule stay the slot's task's)."""
        if isinstance(index, bool) or not 0 <= int(index) < len(self.instructions):
            raise ValueError(f"instruction index must be an int in [0, {len(self.instructions)}), got {index!r}")
        self._field("instruction")[self._slots(slots)] = int(index)

    def run_ticks(self, actions: Any) -> tuple[np.ndarray, np.ndarray]:
        """Advance every slot ``T`` Meta-World steps under ``actions`` (slots, T, 4) in [-1, 1]
        (clipped: hand motion xyz, gripper). Slots that have succeeded are frozen.

        Returns:
            (dense, sparse) rewards summed over the ticks, each (slots,) float32: Meta-World's
            reward, and -1 a tick before success.

        Raises:
            ValueError: bad actions, or ticks past Meta-World's ``max_path_length`` (nothing moves).
        """
        a = _host(actions)
        if a.ndim != 3 or a.shape[0] != self.num_slots or a.shape[2] != self.action_dim:
            raise ValueError(f"actions must have shape ({self.num_slots}, T, {self.action_dim}), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("actions contain NaN or infinity")
        a = np.clip(a, -1.0, 1.0).astype(np.float32)
        alive = np.flatnonzero(~self.success())
        late = [i for i in alive if self.envs[i].curr_path_length + a.shape[1] > self.envs[i].max_path_length]
        if late:
            raise ValueError(
                f"slots {late[:8]} would pass Meta-World's max_path_length ({self.envs[late[0]].max_path_length} "
                "ticks); keep max_episode_steps * n_action_steps within it"
            )
        dense = np.zeros(self.num_slots, dtype=np.float64)
        sparse = np.zeros(self.num_slots, dtype=np.float64)
        success = self._field("success")

        def work(part: np.ndarray) -> None:
            for i in part:
                env = self._load(i)
                for t in range(a.shape[1]):
                    self._obs[i], reward, _, _, info = env.step(a[i, t])
                    dense[i] += float(reward)
                    if info["success"]:
                        success[i] = 1
                        break
                    sparse[i] -= 1.0
                self._keep(i)

        self._map(work, alive)
        return dense.astype(np.float32), sparse.astype(np.float32)

    def expert(self) -> np.ndarray:
        """(slots, 4) float32 actions of Meta-World's scripted policy of each slot's task."""
        acts = [self._experts[self.task_names[t]].get_action(o) for t, o in zip(self.task, self._obs, strict=True)]
        return np.stack(acts).astype(np.float32)

    # -- observations --------------------------------------------------------------------------
    def observation(self) -> np.ndarray:
        """(slots, 39) float32: Meta-World's observation after the last reset or tick."""
        return self._obs.astype(np.float32)

    def proprio(self) -> np.ndarray:
        """(slots, 4) float32: hand position and gripper opening (the observation's first four)."""
        return self._obs[:, :4].astype(np.float32)

    def _renderer(self, t: int) -> tuple[mujoco.Renderer, mujoco.MjvCamera | str, bool]:
        """Task ``t``'s renderer, camera, and whether the camera's image is upside down."""
        env = self.envs[int(np.argmax(self.task == t))]  # the task's first slot
        r = renderer(self.task_names[t], env.model, self.image_size)
        if self.camera != "overview":
            up = env.data.cam(self.camera).xmat.reshape(3, 3)[:, 1]  # the camera frame's y axis: image up
            return r, self.camera, bool(up[2] < 0)
        cam = mujoco.MjvCamera()
        cam.type = mujoco.mjtCamera.mjCAMERA_FREE
        cam.lookat[:] = OVERVIEW["lookat"]
        cam.azimuth, cam.elevation, cam.distance = OVERVIEW["azimuth"], OVERVIEW["elevation"], OVERVIEW["distance"]
        return r, cam, False

    def render(self) -> np.ndarray:
        """(slots, 1, H, W, 3) uint8 frames of the camera."""
        out = np.empty((self.num_slots, 1, self.image_size, self.image_size, 3), dtype=np.uint8)
        for i, (env, t) in enumerate(zip(self.envs, self.task, strict=True)):
            r, cam, flip = self._renderer(int(t))
            r.update_scene(env.data, cam)
            r.render(out=out[i, 0])
            if flip:
                out[i, 0] = out[i, 0, ::-1, ::-1]
        return out

    # -- state ---------------------------------------------------------------------------------
    def get_state(self, slots: Any = None) -> np.ndarray:
        """(len(slots), state_nbytes) uint8 rows of the slots' whole state (all slots if None)."""
        s = self._slots(slots)
        out = np.zeros((s.size, self.state_nbytes), dtype=np.uint8)
        for row, i in enumerate(s):
            env, t, r = self.envs[i], int(self.task[i]), out[row]
            fields = dump_fields(env, self._views[i])
            if len(fields) > self.fields_capacity:
                raise RuntimeError(
                    f"slot {i}'s Python fields take {len(fields)} bytes, more than the row's {self.fields_capacity}"
                )
            self._field("fields_len")[i] = len(fields)
            r[: 8 * len(HEAD)] = self._vars[i].view(np.uint8)
            r[8 * len(HEAD) : self._head_bytes] = self._obs[i].view(np.uint8)
            r[self._head_bytes : self._head_bytes + len(fields)] = np.frombuffer(fields, np.uint8)
            physics = np.empty(self.physics_size[t])
            mujoco.mj_getState(env.model, env.data, physics, STATE_SIG)
            at = self._physics_at + physics.nbytes
            r[self._physics_at : at] = physics.view(np.uint8)
            rows = self._rows[i]
            r[at : at + len(rows)] = np.frombuffer(rows, np.uint8)
            r[-32:] = np.frombuffer(hashlib.sha256(r[:-32].tobytes()).digest(), np.uint8)
        return out

    def set_state(self, slots: Any, states: Any) -> None:
        """Write rows of :meth:`get_state` into ``slots`` (all if None). All-or-nothing: every row
        is checked (checksum, layout, task, flags, finite physics, decodable fields) before any
        slot changes.

        Raises:
            ValueError: a row that is not this simulator's, for this slot's task, or is corrupted.
        """
        s = self._slots(slots)
        rows = _host(states)
        if rows.dtype != np.uint8 or rows.shape != (s.size, self.state_nbytes):
            raise ValueError(
                f"states must be uint8 of shape ({s.size}, {self.state_nbytes}) (rows of get_state), got "
                f"{rows.dtype} {rows.shape}"
            )
        rows = np.ascontiguousarray(rows)
        writes = []
        for row, i in zip(rows, s, strict=True):
            head = row[: 8 * len(HEAD)].view(np.int64)
            tag, task, instr, success, _, n = (int(v) for v in head)
            t = int(self.task[i])
            problem = (
                "its checksum does not match its bytes (corrupted)"
                if hashlib.sha256(row[:-32].tobytes()).digest() != row[-32:].tobytes()
                else "it is another simulator's (another layout)"
                if tag != self._tag
                else f"it holds task {task} ({self.task_names[task] if 0 <= task < len(self.task_names) else '?'}), "
                f"the slot's task {t} ({self.task_names[t]}); restore rows into slots of their own task"
                if task != t
                else "its instruction or success flag is out of range"
                if not (0 <= instr < len(self.instructions) and success in (0, 1) and 0 <= n <= self.fields_capacity)
                else None
            )
            if problem is None:
                at = self._physics_at + 8 * self.physics_size[t]
                physics = row[self._physics_at : at].view(np.float64)
                nbytes = self.model_bytes[t]
                try:
                    fields = load_fields(row[self._head_bytes : self._head_bytes + n].tobytes(), self._views[i])
                except ValueError as e:
                    problem = str(e)
                else:
                    if not np.isfinite(physics).all():
                        problem = "its physics holds non-finite values"
                    writes.append((i, head.copy(), row[8 * len(HEAD) : self._head_bytes].view(np.float64).copy(),
                                   physics.copy(), row[at : at + nbytes].tobytes(), fields))  # fmt: skip
            if problem is not None:
                raise ValueError(f"the state row for slot {i} is refused: {problem}; nothing was written")
        for i, head, obs, physics, model, fields in writes:
            self._rows[i] = model
            env = self._load(i)
            mujoco.mj_setState(env.model, env.data, physics, STATE_SIG)
            write_fields(env, fields)
            self._vars[i], self._obs[i] = head, obs
            mujoco.mj_forward(env.model, env.data)


def _initialize_simulation(self: Any) -> tuple[mujoco.MjModel, mujoco.MjData]:
    """Gymnasium's ``MujocoEnv._initialize_simulation`` for :class:`MetaWorld`'s task classes:
    the model the task's slots share (its class's ``_shared_model``) once one is compiled, with
    data of the instance's own; before that, a model of its own, compiled."""
    shared = type(self)._shared_model
    if shared is None:
        return super(type(self), self)._initialize_simulation()
    return shared, mujoco.MjData(shared)


_RENDERERS: dict[tuple[str, int], mujoco.Renderer] = {}


def renderer(task: str, model: mujoco.MjModel, size: int) -> mujoco.Renderer:
    """The process's renderer of Meta-World task ``task`` at ``size`` px, made once (an OpenGL
    context and the scene's textures take about a second on a CPU) from a copy of ``model`` with
    shadows, reflections and multisampling off. Any slot of the task renders through it: the
    scene is drawn from the slot's ``MjData``; the copy gives the geoms' shapes and colours. With
    shadows off the context needs no shadow map (Meta-World asks for a 4 096-px one, 64 MB a
    task and process) and no offscreen buffer beyond the frame (it asks for 640x480).

    Raises:
        RuntimeError: MuJoCo has no OpenGL backend to render with (named with the fix).
    """
    if (task, size) not in _RENDERERS:
        model = copy.deepcopy(model)
        model.vis.quality.offsamples = 0
        model.vis.quality.shadowsize = 0
        model.vis.global_.offwidth = model.vis.global_.offheight = size
        try:
            r = mujoco.Renderer(model, size, size)
        except (mujoco.FatalError, ImportError) as e:  # no OpenGL context, or no backend library
            raise RuntimeError(
                f"MuJoCo cannot render ({e}); set MUJOCO_GL=egl (or osmesa) before mujoco is first imported, "
                "with the library installed (Debian: libegl1, or libosmesa6)"
            ) from None
        r.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        r.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        _RENDERERS[task, size] = r
    return _RENDERERS[task, size]


def _episode(env: Any, k: int) -> None:
    """Episode ``k`` of a fresh stream on ``env``: a reset and a few steps (for the layout's discovery)."""
    env.np_random = np.random.Generator(np.random.PCG64(k))
    env.reset()
    for t in range(3):
        env.step(np.array([np.sin(t + k), np.cos(t), 0.5, 1.0 - t], dtype=np.float32))
