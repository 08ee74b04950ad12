"""What a simulator provides to be wrapped with a VLA: the :class:`Simulator` (in-graph) and
:class:`ExternalSimulator` (host) protocols, :class:`SplitTicks` (an in-graph simulator whose
physics runs between the step's captured graphs), and :func:`check_simulator`, which names what
one lacks. This module is all a simulator author reads.

An in-graph simulator keeps its whole state in slot buffers of the env's one
:class:`flashrt.runtime.BufferSet` (declared by :meth:`Simulator.specs`, named ``sim.*``) and
runs its tick, reset, render and observations as fixed-shape programs over them: torch, Triton
or Warp kernels launched on the current stream, with no host synchronisation. The env's engine
then captures one step (policy and simulator together) as one graph, and a capsule of the buffer
set holds the simulator's state beside the policy's: reset, fork and rollback are byte copies.
The built-in :class:`flashrt_gym.sims.tabletop.Tabletop` is the first implementation.

Conventions the engine relies on:

- Episodes are drawn from a per-slot counter-based RNG stream that lives in the simulator's own
  buffers: :meth:`Simulator.seed` sets each slot's stream, :meth:`Simulator.reset` draws the next
  episode of every masked slot (so autoreset inside the step needs no host and no pool, and a
  slot's sequence of episodes is a function of its seed alone).
- ``success`` and ``instruction`` are ``(slots,)`` views of its buffers (bool, int64): the step's
  ``terminated`` is ``success``; ``instruction`` indexes :attr:`Simulator.instructions`, the
  language the policy reads.
- A policy may act in more dimensions than the simulator has (pi0 pads actions and state to 32):
  the simulator executes the first ``action_dim`` of each action and its ``proprio_dim`` numbers
  fill the start of the policy's state input (the rest stay zero), as LeRobot pads a robot's.
- A simulator may name the policy trained for it, a folder, as ``pretrained_weights`` (in-graph
  and external alike): the env loads it when it is given no weights, and the shipped tabletop
  policy when neither names one.

An :class:`ExternalSimulator` steps on the host instead (MuJoCo's C library, a Gymnasium vector
env, a robot stack) on NumPy arrays, and can read and write each slot's whole state as a row of
bytes (:meth:`~ExternalSimulator.get_state` / :meth:`~ExternalSimulator.set_state`). The engine
keeps a device mirror of those rows and of what the policy reads
(:mod:`flashrt_gym.engine.host_link`), so capsules, forks and rollbacks hold it too; the host
draws a finished slot's next episode during the step's hand-off (its own seeded stream).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from flashrt.runtime import BufferSet, BufferSpec


@runtime_checkable
class Simulator(Protocol):
    """A batched simulator whose state is buffers of the env's buffer set (see the module)."""

    instructions: Sequence[str]
    """The task's language instructions; ``instruction`` indexes them."""
    num_cameras: int
    image_size: int
    action_dim: int
    """Numbers per tick the simulator executes."""
    proprio_dim: int
    observation_dim: int
    """Length of :meth:`observation`, the low-dimensional observation (``obs_mode="state"``)."""
    observation_bound: float | None
    """Every observation number lies in ``[-bound, bound]`` (None: unbounded)."""

    def specs(self) -> list[BufferSpec]:
        """The simulator's per-slot state buffers, named ``sim.*``."""
        ...

    def bind(self, bufs: BufferSet) -> Simulator:
        """Take its buffers from ``bufs`` (once, before anything runs) and return itself."""
        ...

    @property
    def success(self) -> torch.Tensor:
        """(slots,) bool: the slot's episode has succeeded."""
        ...

    @property
    def instruction(self) -> torch.Tensor:
        """(slots,) int64 index into :attr:`instructions`."""
        ...

    @property
    def rng_key(self) -> torch.Tensor:
        """(slots,) int64 key of each slot's episode stream (a fork with reseed gives each
        destination a new one, so its later episodes differ)."""
        ...

    def identity(self) -> str:
        """A string that differs whenever two simulators' states are not interchangeable (it
        enters the deployment digest that capsules are checked against)."""
        ...

    def validate(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` naming the buffer if the ``sim.*`` tensors (a capsule's, before
        it is restored) hold values the simulator cannot step from."""
        ...

    def seed(self, seeds: torch.Tensor) -> None:
        """Give every slot the RNG stream of its int64 seed ``(slots,)``, from its first draw."""
        ...

    def reset(self, mask: torch.Tensor | None = None, instruction: torch.Tensor | None = None) -> None:
        """Draw the next episode of each slot's stream where ``mask`` (all if None); capturable.
        ``instruction`` (slots,) int64 forces instruction indices (-1 keeps the draw)."""
        ...

    def run_ticks(self, actions: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """Advance every slot ``T`` ticks under ``actions (slots, T, action_dim)`` and write the
        summed dense and sparse rewards into ``dense``/``sparse`` (float32 (slots,)); capturable.
        A slot that has succeeded is frozen and earns nothing."""
        ...

    def render(self, out: torch.Tensor) -> None:
        """Every slot's camera images into ``out (slots, num_cameras, H, W, 3)`` uint8."""
        ...

    def proprio(self, out: torch.Tensor) -> None:
        """(slots, proprio_dim) float32 proprioceptive state into ``out``."""
        ...

    def observation(self, out: torch.Tensor) -> None:
        """(slots, observation_dim) float32 low-dimensional observation into ``out``."""
        ...


class BoundState:
    """What every simulator derives from the typed view of its ``sim.*`` buffers (a dataclass with
    ``success``, ``instruction`` and ``key`` fields) that its ``bind`` sets as ``self._state``."""

    _state: Any = None

    @property
    def state(self) -> Any:
        if self._state is None:
            raise ValueError(f"bind the {type(self).__name__} to a buffer set first: make it, then .bind(bufs)")
        return self._state

    @property
    def success(self) -> torch.Tensor:
        return self.state.success

    @property
    def instruction(self) -> torch.Tensor:
        return self.state.instruction

    @property
    def rng_key(self) -> torch.Tensor:
        return self.state.key


@runtime_checkable
class SplitTicks(Protocol):
    """An in-graph simulator whose physics cannot be recorded into the env's torch capture (MuJoCo
    Warp's solver loop is a conditional node of Warp's own graph) but runs on the device with no
    host synchronisation. When :attr:`physics_outside_capture` is true, the env's step is three
    launches on one stream: a captured graph of the policy ending with :meth:`begin_ticks`,
    :meth:`physics`, and a captured graph starting with :meth:`end_ticks` (episode flags,
    autoreset, render, encode). Its ``run_ticks`` must equal the three in a row; its state stays
    in its ``sim.*`` buffers, so capsules are unchanged. When the step's actions are refused,
    :meth:`physics` still runs on the scratch it was last given and must change no ``sim.*``
    buffer (the two graphs skip their bodies)."""

    physics_outside_capture: bool

    def begin_ticks(self, actions: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """The capturable part of ``run_ticks`` before the physics (reads the slots' buffers)."""
        ...

    def physics(self, ticks: int) -> None:
        """The physics of ``ticks`` ticks over what :meth:`begin_ticks` loaded, on the current
        stream, no host synchronisation, never inside a torch capture."""
        ...

    def end_ticks(self, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        """The capturable part of ``run_ticks`` after the physics (writes the slots' buffers and
        the rewards)."""
        ...


def splits_ticks(sim: object) -> bool:
    """Whether the env's step runs ``sim``'s physics between two captured parts (a
    :class:`SplitTicks` simulator that asks for it).

    Raises:
        TypeError: ``sim`` asks for it (``physics_outside_capture``) without the three methods.
    """
    if not getattr(sim, "physics_outside_capture", False):
        return False
    missing = [n for n in ("begin_ticks", "physics", "end_ticks") if not callable(getattr(sim, n, None))]
    if missing:
        raise TypeError(
            f"{type(sim).__name__} sets physics_outside_capture but lacks {', '.join(missing)}: define the three "
            "parts of run_ticks (flashrt_gym.simulator.SplitTicks), or leave physics_outside_capture false"
        )
    return True


@runtime_checkable
class ExternalSimulator(Protocol):
    """A batched simulator stepped on the host; every array is NumPy with the slots first."""

    instructions: Sequence[str]
    num_cameras: int
    image_size: int
    action_dim: int
    proprio_dim: int
    observation_dim: int
    observation_bound: float | None
    state_nbytes: int
    """Bytes of one slot's state row: everything the next tick and reset read (physics with the
    solver's warm start, the slot's RNG stream, its instruction, its flags)."""

    def identity(self) -> str:
        """A string that differs whenever two simulators' state rows are not interchangeable."""
        ...

    def seed(self, seeds: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Restart the RNG stream of each slot (all, or ``slots``) from its int64 seed."""
        ...

    def reset(self, mask: np.ndarray | None = None) -> None:
        """Draw the next episode of each slot's stream where ``mask`` (all if None)."""
        ...

    def run_ticks(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Advance every slot ``T`` ticks under ``actions (slots, T, action_dim)`` float32; the
        summed (dense, sparse) float32 rewards. A slot that has succeeded is frozen."""
        ...

    def set_instruction(self, index: int, slots: np.ndarray | None = None) -> None:
        """Give ``slots`` (all if None) the instruction ``index`` from the next tick on."""
        ...

    def success(self) -> np.ndarray:
        """(slots,) bool."""
        ...

    def instruction(self) -> np.ndarray:
        """(slots,) int64 index into ``instructions``."""
        ...

    def render(self) -> np.ndarray:
        """(slots, num_cameras, H, W, 3) uint8."""
        ...

    def proprio(self) -> np.ndarray:
        """(slots, proprio_dim) float32."""
        ...

    def observation(self) -> np.ndarray:
        """(slots, observation_dim) float32."""
        ...

    def get_state(self, slots: np.ndarray | None = None) -> np.ndarray:
        """(k, state_nbytes) uint8 state rows of ``slots`` (all if None)."""
        ...

    def set_state(self, slots: np.ndarray | None, states: np.ndarray) -> None:
        """Write state rows; checks every row before writing any (a bad row changes nothing)."""
        ...


def is_external(sim: object) -> bool:
    """Whether ``sim`` is an external simulator (it moves state rows in and out) rather than an
    in-graph one; decided on its class, so no property of an unbound simulator is read."""
    return all(callable(getattr(type(sim), name, None)) for name in ("get_state", "set_state"))


_MISSING = object()


def protocol_members(protocol: type) -> tuple[list[str], list[str]]:
    """A protocol's members, in declaration order.

    Args:
        protocol: :class:`Simulator` or :class:`ExternalSimulator`.

    Returns:
        ``(attributes, methods)``: annotated names and properties are attributes (they must be
        present), functions are methods (they must be callable).
    """
    attributes = [n for n in getattr(protocol, "__annotations__", {}) if not n.startswith("_")]
    methods = []
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            attributes.append(name)
        elif callable(value):
            methods.append(name)
    return attributes, methods


def _callable(value: object) -> bool:
    return callable(value) or isinstance(value, (classmethod, staticmethod))


def missing_members(sim: object) -> tuple[type, list[str]]:
    """The protocol ``sim`` (a simulator, or a simulator class) aims at and the members it lacks.

    ``sim`` aims at :class:`ExternalSimulator` when it defines ``get_state`` or ``set_state``,
    else at the in-graph :class:`~flashrt_gym.simulator.Simulator`. Members are looked up without
    running them (``inspect.getattr_static``), so an unbound simulator's properties are not read.
    For a class only the methods can be checked: data members are set by its ``__init__``.

    Args:
        sim: a simulator instance or class.

    Returns:
        The protocol, and the names it declares that ``sim`` lacks (a method counts as lacking
        when ``sim``'s member of that name is not callable), in the protocol's order.
    """
    aims_external = any(inspect.getattr_static(sim, n, _MISSING) is not _MISSING for n in ("get_state", "set_state"))
    protocol = ExternalSimulator if aims_external else Simulator
    attributes, methods = protocol_members(protocol)
    missing = (
        [] if isinstance(sim, type) else [n for n in attributes if inspect.getattr_static(sim, n, _MISSING) is _MISSING]
    )
    missing += [n for n in methods if not _callable(inspect.getattr_static(sim, n, None))]
    return protocol, missing


def check_simulator(sim: object) -> None:
    """Refuse a simulator (or simulator class) that lacks members of the protocol it aims at,
    naming every missing member in one error, before anything reads them.

    :func:`flashrt_gym.register_simulator` calls it on a simulator class when it is registered,
    and every env's engine on the simulator it is given, before anything else touches it.

    Args:
        sim: a simulator instance, or a class (then only its methods are checked).

    Raises:
        TypeError: ``sim`` lacks members of :class:`ExternalSimulator` (it defines ``get_state``
            or ``set_state``) or of :class:`~flashrt_gym.simulator.Simulator` (otherwise).
    """
    protocol, missing = missing_members(sim)
    if missing:
        what = sim.__name__ if isinstance(sim, type) else type(sim).__name__
        raise TypeError(
            f"{what} is not a complete {protocol.__module__}.{protocol.__name__}: it lacks {', '.join(missing)}. "
            f"Define every member the protocol lists (a complete example: flashrt_gym/sims/push/mujoco_cpu.py for an "
            f"external simulator, flashrt_gym/sims/tabletop/tabletop.py for an in-graph one)"
        )
