"""What a simulator provides to be wrapped with a VLA: the in-graph simulator protocol.

An in-graph simulator keeps its whole state in slot buffers of the env's one
:class:`flashrt.runtime.BufferSet` (declared by :meth:`Simulator.specs`, named ``sim.*``) and
runs its tick, reset, render and observations as fixed-shape programs over them: torch, Triton
or Warp kernels launched on the current stream, with no host synchronisation. The env's engine
then captures one step (policy and simulator together) as one graph, and a capsule of the buffer
set holds the simulator's state beside the policy's: reset, fork and rollback are byte copies.
The built-in :class:`flashrt_gym.tasks.Tabletop` is the first implementation.

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

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
