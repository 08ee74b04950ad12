"""Everything a Meta-World task instance's next step and reset read, found by rules, as bytes.

A Meta-World task is a Gymnasium ``MujocoEnv`` whose state lies in three places, and a state row
must hold all three (a test drops each and sees the continuation depart):

- MuJoCo's integration state (``mj_getState`` with ``mjSTATE_INTEGRATION``): positions,
  velocities, the solver's warm start, controls, mocap poses.
- Per-episode *model* rows: at every reset a task moves its fixtures and goal marker through the
  ``MjModel`` (``body_pos``, ``site_pos``, ...). Which fields, :func:`episode_model_fields` finds
  by diffing a fresh instance's model before and after a few resets and steps, not from a list.
- The task's Python fields (``_target_pos``, ``_prev_obs``, ``obj_init_pos``,
  ``curr_path_length``, the reset RNG, task extras): :func:`python_fields` takes every entry of
  the instance's ``__dict__`` except the MuJoCo structures, spaces and renderers the instance
  builds for itself; :func:`encode` writes them by value as JSON, except arrays that are *live
  views* of the instance's own ``MjData`` / ``MjModel`` memory (``init_left_pad`` is
  ``data.xpos``'s row), which it writes as references that :func:`decode` re-binds to the
  restoring instance's memory. A value of a type the rule does not know is refused by name, so a
  new task's field is never dropped silently.

:func:`reset_mocap_welds` is the shim that lets Meta-World 3.1.1 (written for MuJoCo 3.3, whose
weld constraints take 11 numbers) build its scenes on MuJoCo 4 (12 numbers).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable
from typing import Any

import gymnasium
import mujoco
import numpy as np
from gymnasium.envs.mujoco.mujoco_rendering import MujocoRenderer

WELD_DATA = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 5.0)
"""The weld numbers Meta-World gives its mocap welds: anchor (3), relative pose (position 3,
quaternion 4) and torque scale (1), MuJoCo 3's layout; later entries keep their compiled values."""

STRUCTURE = (mujoco.MjModel, mujoco.MjData, gymnasium.spaces.Space, MujocoRenderer)
"""Values an instance builds for itself and never holds episode state in: MuJoCo's structures
(held through the physics and model rows), Gymnasium spaces and renderers."""

BIT_GENERATORS = {name: getattr(np.random, name) for name in ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")}
"""NumPy bit generators a decoded RNG may name (any other name is refused)."""


def reset_mocap_welds(env: Any) -> None:
    """Meta-World's ``SawyerMocapBase.reset_mocap_welds`` for MuJoCo 4: the weld numbers
    (:data:`WELD_DATA`) into the first 11 entries of each weld constraint's ``eq_data`` row,
    where Meta-World 3.1.1 assigns a whole row and fails on MuJoCo 4's 12-wide rows.

    Args:
        env: a Meta-World task instance (its ``model`` is changed in place).
    """
    model = env.model
    if model.nmocap > 0:
        welds = np.flatnonzero(model.eq_type == mujoco.mjtEq.mjEQ_WELD)
        model.eq_data[welds, : len(WELD_DATA)] = WELD_DATA


def mujoco_arrays(owner: mujoco.MjModel | mujoco.MjData) -> dict[str, np.ndarray]:
    """Every NumPy array attribute of a MuJoCo structure, by name.

    Args:
        owner: an ``MjModel`` or ``MjData``.

    Returns:
        Its arrays (views of its own memory), by attribute name.
    """
    out = {}
    for name in dir(owner):
        if not name.startswith("_"):
            value = getattr(owner, name)
            if isinstance(value, np.ndarray):
                out[name] = value
    return out


def model_rows(model: mujoco.MjModel, fields: Iterable[str]) -> bytes:
    """A state row's model part.

    Args:
        model: the slot's model.
        fields: names of its arrays (:func:`episode_model_fields`).

    Returns:
        The arrays' bytes, concatenated in order.
    """
    return b"".join(np.ascontiguousarray(getattr(model, f)).tobytes() for f in fields)


def write_model_rows(model: mujoco.MjModel, fields: Iterable[str], raw: bytes) -> None:
    """Write a state row's model part back.

    Args:
        model: the slot's model (changed in place).
        fields: the names :func:`model_rows` was given.
        raw: its bytes, for arrays of this model's shapes.
    """
    at = 0
    for f in fields:
        a = getattr(model, f)
        a[...] = np.frombuffer(raw, a.dtype, a.size, at).reshape(a.shape)
        at += a.nbytes


def episode_model_fields(env: Any, draws: Callable[[Any, int], None], count: int = 3) -> tuple[str, ...]:
    """The ``MjModel`` arrays a task writes per episode: those of a fresh instance ``env`` that
    differ from their built values after ``count`` episodes (``draws(env, k)`` resets episode
    ``k`` and steps it).

    Args:
        env: a fresh task instance (it runs the episodes).
        draws: runs episode ``k`` (a reset from the ``k``-th stream and a few steps) on it.
        count: how many episodes to diff against the built model.

    Returns:
        The names, sorted; fixed over the simulator's life, they fix a state row's layout.
    """
    fresh = {name: a.tobytes() for name, a in mujoco_arrays(env.model).items()}
    changed: set[str] = set()
    for k in range(count):
        draws(env, k)
        now = mujoco_arrays(env.model)
        changed |= {name for name, b in fresh.items() if now[name].tobytes() != b}
    return tuple(sorted(changed))


def python_fields(env: Any) -> dict[str, Any]:
    """The instance's episode state in Python.

    Args:
        env: a Meta-World task instance.

    Returns:
        Its ``__dict__`` without :data:`STRUCTURE` values (the entries themselves, not copies).
    """
    return {k: v for k, v in vars(env).items() if not isinstance(v, STRUCTURE)}


class Views:
    """Where the arrays of an instance's ``MjData`` and ``MjModel`` lie in memory, to tell a live
    view from a value (:func:`encode`) and to re-bind one (:func:`decode`)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.spans: list[tuple[int, int, str, str]] = []

    def _map(self) -> None:
        """(Re)read the arrays' addresses: the arena's arrays move as contacts come and go."""
        self.spans = [
            (a.__array_interface__["data"][0], a.nbytes, owner, name)
            for owner in ("data", "model")
            for name, a in mujoco_arrays(getattr(self.env, owner)).items()
            if a.nbytes
        ]

    def find(self, a: np.ndarray) -> list[Any] | None:
        """Where an array lies, if it is a live view.

        An array is a live view when its memory is not NumPy's (the root of its ``base`` chain is
        no array) and lies inside an array of the instance's ``MjData`` or ``MjModel``.

        Args:
            a: a field's array.

        Returns:
            ``[owner, name, offset, shape, strides, dtype]`` of a live view, else None.

        Raises:
            TypeError: an array in memory that neither NumPy nor this instance's MuJoCo owns.
        """
        root = a
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        if isinstance(root, (np.ndarray, bytes, bytearray)):  # memory NumPy or Python owns: a value
            return None
        start, end = a.__array_interface__["data"][0], a.__array_interface__["data"][0] + a.nbytes
        for attempt in range(2):
            inside = [s for s in self.spans if s[0] <= start and end <= s[0] + s[1]]
            if inside:
                base, _, owner, name = min(inside, key=lambda s: s[1])
                ref = [owner, name, start - base, list(a.shape), list(a.strides), a.dtype.str]
                if self.bind(ref).__array_interface__["data"][0] == start:
                    return ref
            if attempt == 0:
                self._map()
        raise TypeError("an array in memory that is neither NumPy's nor this instance's MjData's or MjModel's")

    def bind(self, ref: list[Any]) -> np.ndarray:
        """The restoring instance's view that a reference names.

        Args:
            ref: :meth:`find`'s reference (from a row).

        Returns:
            The view of this instance's array.

        Raises:
            ValueError: a reference to no array of the instance, or reaching outside it.
        """
        owner, name, offset, shape, strides, dtype = ref
        if owner not in ("data", "model") or not isinstance(name, str):
            raise ValueError(f"a live view names {owner}.{name}, not an array of the instance's MjData or MjModel")
        base = getattr(getattr(self.env, owner), name, None)
        if not isinstance(base, np.ndarray):
            raise ValueError(f"a live view names {owner}.{name}, which this instance's {owner} does not have")
        dt = np.dtype(dtype)
        last = (
            offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + dt.itemsize
            if all(shape)
            else offset
        )
        if offset < 0 or min(strides, default=0) < 0 or last > base.nbytes:
            raise ValueError(f"a live view of {owner}.{name} reaches outside its {base.nbytes} bytes")
        return np.ndarray(shape, dt, buffer=base, offset=offset, strides=strides)


def encode(value: Any, views: Views, where: str = "") -> Any:
    """A JSON-able tree of ``value`` that :func:`decode` turns back into an equal value of the
    same types (live views of MuJoCo memory as references to re-bind).

    Args:
        value: a Python field's value.
        views: the source instance's memory map.
        where: the field's path, for the error.

    Returns:
        The tree.

    Raises:
        TypeError: a value of a type the rule cannot hold by value (named with its field).
    """
    if value is None or type(value) in (bool, int, float, str):  # exact types: np.float64 is a float
        return value
    if type(value) is np.ndarray:
        if value.dtype.hasobject:
            raise TypeError(f"field {where}: an object array; the capsule rule holds numeric arrays only")
        ref = views.find(value)
        if ref is not None:
            return {"view": ref}
        raw = np.ascontiguousarray(value).tobytes()
        return {"nd": value.dtype.str, "shape": list(value.shape), "b": base64.b64encode(raw).decode()}
    if isinstance(value, np.generic) and not value.dtype.hasobject:
        return {"np": value.dtype.str, "b": base64.b64encode(value.tobytes()).decode()}
    if type(value) is np.random.Generator:
        return {"rng": value.bit_generator.state}
    if type(value) in (list, tuple):
        return {type(value).__name__: [encode(v, views, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) is dict:
        return {"dict": [[encode(k, views, where), encode(v, views, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(
        f"field {where}: the capsule rule cannot hold a {type(value).__module__}.{type(value).__qualname__} by value; "
        "teach flashrt_gym.sims.metaworld_state.encode the type (or STRUCTURE, if the instance rebuilds it)"
    )


def decode(tree: Any, views: Views) -> Any:
    """The value :func:`encode` wrote, live views bound to ``views``' instance.

    Args:
        tree: :func:`encode`'s tree (from a row).
        views: the restoring instance's memory map.

    Returns:
        The value.

    Raises:
        ValueError: a tree :func:`encode` cannot have written.
    """
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    keys = set(tree) if isinstance(tree, dict) else set()
    if keys == {"nd", "shape", "b"}:
        if np.dtype(tree["nd"]).hasobject:
            raise ValueError("an encoded array of objects")
        return np.frombuffer(base64.b64decode(tree["b"]), np.dtype(tree["nd"])).reshape(tree["shape"]).copy()
    if keys == {"np", "b"}:
        return np.frombuffer(base64.b64decode(tree["b"]), np.dtype(tree["np"]))[0]
    if len(keys) != 1:
        raise ValueError(f"not an encoded field value: {str(tree)[:80]}")
    (kind, body), *_ = tree.items()
    if kind == "view":
        return views.bind(body)
    if kind == "rng":
        if body.get("bit_generator") not in BIT_GENERATORS:
            raise ValueError(f"an encoded RNG names bit generator {body.get('bit_generator')!r}")
        g = np.random.Generator(BIT_GENERATORS[body["bit_generator"]]())
        g.bit_generator.state = body
        return g
    if kind in ("list", "tuple"):
        items = [decode(v, views) for v in body]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {decode(k, views): decode(v, views) for k, v in body}
    raise ValueError(f"not an encoded field value: kind {kind!r}")


def dump_fields(env: Any, views: Views) -> bytes:
    """The instance's Python fields as bytes.

    Args:
        env: a Meta-World task instance.
        views: its memory map.

    Returns:
        Its :func:`python_fields`, :func:`encode`-d, as UTF-8 JSON.

    Raises:
        TypeError: a field the rule cannot hold (named).
    """
    tree = {k: encode(v, views, k) for k, v in python_fields(env).items()}
    return json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()


def load_fields(raw: bytes, views: Views) -> dict[str, Any]:
    """Decode :func:`dump_fields`' bytes for ``views``' instance (nothing is written yet).

    Args:
        raw: the bytes.
        views: the restoring instance's memory map (live views are bound to it).

    Returns:
        The fields' values, by name.

    Raises:
        ValueError: bytes :func:`dump_fields` cannot have written.
    """
    try:
        tree = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the Python fields are not the JSON dump_fields writes ({e})") from None
    if not isinstance(tree, dict):
        raise ValueError("the Python fields are not a JSON object")
    try:
        return {k: decode(v, views) for k, v in tree.items()}
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
        raise ValueError(f"the Python fields do not decode: {e}") from None


def write_fields(env: Any, fields: dict[str, Any]) -> None:
    """Make ``env``'s Python fields exactly ``fields``.

    Args:
        env: the restoring instance.
        fields: :func:`load_fields`' values: each is set, and the instance's fields the row does
            not hold are dropped (the instance then reads the class's value, as one that never
            set it does).
    """
    own = vars(env)
    for k in set(python_fields(env)) - set(fields):
        del own[k]
    own.update(fields)
