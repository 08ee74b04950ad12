"""The engine's hand-offs to a simulator's host side: the :class:`HostLink` interface its verbs
call at fixed points, :data:`NO_HOST_LINK` (an in-graph simulator has no host side) and
:class:`Mirror`, the in-graph face of an :class:`~flashrt_gym.simulator.ExternalSimulator`.

The mirror is an in-graph :class:`~flashrt_gym.simulator.Simulator` over device buffers that hold,
per slot, the host's state row and what the policy and the agent read of it (observation,
proprioception, camera images, success, instruction). One env step is then the policy's graph
(the agent's action to the chunk), one host hand-off (the chunk down, the simulator's ticks, the
results up) and a second graph (episode flags, autoreset, encode, outputs). Because the state
rows live in the env's buffer set, a capsule holds the policy and the simulator together, and a
restore writes both, all-or-nothing.

Autoreset keeps the in-graph convention: the host draws the next episode of every finished slot
(its own seeded stream) during the hand-off and uploads it as *pending*; the mirror's
:meth:`Mirror.reset` then moves a slot's pending data in where the step's done mask says, inside
the second graph, after the final observation was taken.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from flashrt.runtime import BufferSet, BufferSpec, Capsule, scratch, slot
from flashrt.runtime.views import bind_views
from flashrt_gym.simulator import BoundState, ExternalSimulator


class HostLink(Protocol):
    """What the engine's verbs hand to a simulator's host side, each at one fixed point of the
    verb (the step's own hand-off is :meth:`Mirror.host_step`, in the step plan of an external
    simulator)."""

    def host_start(self, seeds: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """New episodes of the masked slots (all if None), reseeded first when ``seeds`` are given."""

    def host_restore(self, slots: Sequence[int], capsule: Capsule) -> None:
        """``capsule``'s simulator state into ``slots``, before the buffer set is restored (a
        refused row changes nothing)."""

    def host_fork(self, src: int, dst: Sequence[int]) -> None:
        """Slot ``src``'s state into ``dst``, after the buffer set's fork."""

    def host_reseed(self, idx: torch.Tensor, dst: Sequence[int]) -> None:
        """The reseeded streams of ``dst`` (the simulator's keys at ``idx``) into the host."""

    def host_set_instruction(self, index: int, slots: torch.Tensor | None) -> None:
        """Instruction ``index`` for ``slots`` (all if None), before the device's copy is set."""


class NoHostLink:
    """The :class:`HostLink` of an in-graph simulator: its whole state is in the buffer set, so
    every hand-off is nothing."""

    def host_start(self, seeds: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """Nothing: the in-graph simulator seeds and resets inside the engine's programs."""

    def host_restore(self, slots: Sequence[int], capsule: Capsule) -> None:
        """Nothing: the buffer set's restore is the simulator's."""

    def host_fork(self, src: int, dst: Sequence[int]) -> None:
        """Nothing: the buffer set's fork is the simulator's."""

    def host_reseed(self, idx: torch.Tensor, dst: Sequence[int]) -> None:
        """Nothing: the reseeded keys are the simulator's."""

    def host_set_instruction(self, index: int, slots: torch.Tensor | None) -> None:
        """Nothing: the device's instruction is the simulator's."""


NO_HOST_LINK = NoHostLink()
"""The host link of every in-graph simulator."""


@dataclass(frozen=True)
class MirrorState:
    """What the env keeps of the host simulator per slot (``sim.*``; ``sim.next.*`` holds the
    pending next episode of the slots that finished in the current step)."""

    state: torch.Tensor
    success: torch.Tensor
    instruction: torch.Tensor
    key: torch.Tensor
    observation: torch.Tensor
    proprio: torch.Tensor
    image: torch.Tensor


UPLOADED = ("state", "success", "instruction", "observation", "proprio", "image")


class Mirror(BoundState):
    """The in-graph face of an :class:`ExternalSimulator`: device buffers the env's graphs read,
    filled by the host hand-offs (``host_*``) the engine runs between them."""

    def __init__(self, host: ExternalSimulator) -> None:
        self.host = host
        for name in ("instructions", "num_cameras", "image_size", "action_dim", "proprio_dim", "observation_dim"):
            setattr(self, name, getattr(host, name))
        self.observation_bound = host.observation_bound
        self._state: MirrorState | None = None
        self._next: MirrorState | None = None

    def specs(self) -> list[BufferSpec]:
        h = self.host
        per_slot = {
            "state": ((h.state_nbytes,), torch.uint8),
            "success": ((), torch.bool),
            "instruction": ((), torch.int64),
            "key": ((), torch.int64),
            "observation": ((h.observation_dim,), torch.float32),
            "proprio": ((h.proprio_dim,), torch.float32),
            "image": ((h.num_cameras, h.image_size, h.image_size, 3), torch.uint8),
        }
        return [slot(f"sim.{k}", *v) for k, v in per_slot.items()]

    def scratch_specs(self, n: int) -> list[BufferSpec]:
        """The pending next episodes (uploaded by the step's hand-off, moved in by :meth:`reset`)."""
        return [scratch(f"sim.next.{s.name[4:]}", (n, *s.shape), s.dtype) for s in self.specs()]

    def bind(self, bufs: BufferSet) -> Mirror:
        slots = len(self.host.success())
        if slots != bufs.num_slots:
            raise ValueError(
                f"the external simulator has {slots} slots, the env {bufs.num_slots}: make it with num_envs slots"
            )
        self._state = bind_views(MirrorState, bufs, "sim")
        self._next = bind_views(MirrorState, bufs, "sim.next")
        return self

    def identity(self) -> str:
        return f"external|{self.host.identity()}"

    def validate(self, state: Mapping[str, torch.Tensor]) -> None:
        """Index and flag checks here; the host checks its rows when they are written."""
        instr = state["sim.instruction"]
        if instr.numel() and (int(instr.min()) < 0 or int(instr.max()) >= len(self.instructions)):
            raise ValueError(f"sim.instruction holds indices outside [0, {len(self.instructions)})")
        if state["sim.success"].numel() and int(state["sim.success"].view(torch.uint8).max()) > 1:
            raise ValueError("sim.success holds bytes other than 0 and 1")

    # -- the in-graph protocol over the mirrored buffers ----------------------------------------
    def seed(self, seeds: torch.Tensor) -> None:
        """The keys the host's streams were seeded with (the host itself is seeded by
        :meth:`host_start`)."""
        self.state.key.copy_(seeds)

    def reset(self, mask: torch.Tensor | None = None, instruction: torch.Tensor | None = None) -> None:
        """Move each masked slot's pending next episode in (the host drew it already)."""
        if instruction is not None:
            raise ValueError("an external simulator's instructions are set on the host (set_instruction)")
        for name in UPLOADED:
            cur, nxt = getattr(self.state, name), getattr(self._next, name)
            if mask is None:
                cur.copy_(nxt)
            else:
                cur.copy_(torch.where(mask.view(-1, *[1] * (cur.dim() - 1)), nxt, cur))

    def run_ticks(self, actions: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor) -> None:
        raise RuntimeError("an external simulator ticks on the host, between the step's graphs")

    def render(self, out: torch.Tensor) -> None:
        out.copy_(self.state.image)

    def proprio(self, out: torch.Tensor) -> None:
        out.copy_(self.state.proprio)

    def observation(self, out: torch.Tensor) -> None:
        out.copy_(self.state.observation)

    # -- host hand-offs ---------------------------------------------------------------------------
    def _upload(self, into: MirrorState) -> None:
        h = self.host
        for name, value in (
            ("state", h.get_state()),
            ("success", h.success()),
            ("instruction", h.instruction()),
            ("observation", h.observation()),
            ("proprio", h.proprio()),
            ("image", h.render()),
        ):
            dst = getattr(into, name)
            dst.copy_(torch.from_numpy(np.ascontiguousarray(value)).view(dst.dtype).reshape(dst.shape))

    def host_start(self, seeds: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """Seed (if ``seeds``) and reset the host's masked slots; upload them as pending."""
        where = None if mask is None else np.flatnonzero(mask.cpu().numpy())
        if seeds is not None:
            s = seeds.cpu().numpy()
            self.host.seed(s if where is None else s[where], where)
        self.host.reset(None if mask is None else mask.cpu().numpy())
        self._upload(self._next)

    def host_step(self, chunk: torch.Tensor, steps: torch.Tensor, max_steps: int, autoreset: bool) -> tuple:
        """The step's hand-off: ``chunk`` (slots, T, action_dim) down, the ticks on the host, the
        slots' states up; with ``autoreset`` the finished slots' next episodes drawn and uploaded
        as pending. Returns the (dense, sparse) rewards as host arrays."""
        dense, sparse = self.host.run_ticks(chunk.cpu().numpy())
        self._upload(self._state)
        if autoreset:
            done = self.host.success() | (steps.cpu().numpy() + 1 >= max_steps)
            if done.any():  # the host moves on now; the device does in the second graph
                self.host.reset(done)
                self._upload(self._next)
        return dense, sparse

    def host_write(self, slots: Sequence[int] | None, rows: torch.Tensor) -> None:
        """Write restored state rows (slots, state_nbytes) into the host (all-or-nothing there)."""
        where = None if slots is None else np.asarray(slots, dtype=np.int64)
        self.host.set_state(where, rows.cpu().numpy())

    def host_refresh(self) -> None:
        """Mirror the host's current state of every slot (after an instruction change or a reseed)."""
        self._upload(self._state)

    def host_restore(self, slots: Sequence[int], capsule: Capsule) -> None:
        """``capsule``'s state rows of ``slots`` into the host (the host refuses a bad row first)."""
        self.host_write(slots, capsule.tensor("sim.state"))

    def host_fork(self, src: int, dst: Sequence[int]) -> None:
        """Slot ``src``'s state row (as the buffer set holds it) into the host's ``dst`` slots."""
        self.host_write(dst, self.state.state[src : src + 1].expand(len(dst), -1))

    def host_reseed(self, idx: torch.Tensor, dst: Sequence[int]) -> None:
        """The host's ``dst`` slots reseeded from the mirrored keys at ``idx``; then mirrored back."""
        self.host.seed(self.rng_key[idx].cpu().numpy(), np.asarray(dst))
        self.host_refresh()

    def host_set_instruction(self, index: int, slots: torch.Tensor | None) -> None:
        """Instruction ``index`` for the host's ``slots`` (all if None); then mirrored back."""
        self.host.set_instruction(index, None if slots is None else slots.cpu().numpy())
        self.host_refresh()
