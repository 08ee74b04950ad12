"""An external simulator whose slots run in worker processes: :class:`Processes`.

Threads step a host simulator's slots only as far as Python's GIL lets them. Meta-World's step,
for one, spends about a third of its time in Python (its reward and observation code), so threads
gain at most ~3× on any number of cores. :class:`Processes` splits the slots into contiguous
shards, each an instance of the same simulator in a worker process of its own, and forwards every
call of :class:`~flashrt_gym.simulator.ExternalSimulator`. Slot-indexed arguments are split, results
joined in slot order, and every shard works at once. A slot's computation is its own, so the bytes
are those of one process for any count (a test holds that). As SB3's ``SubprocVecEnv`` does, the
workers start by ``spawn`` (nothing of the parent's threads, CUDA or OpenGL contexts is inherited)
and talk through pipes. As with ``SubprocVecEnv``, a script that makes one keeps its top-level
work under ``if __name__ == "__main__":`` (a spawned worker imports the script's module).

``set_state`` stays all-or-nothing across shards: the rows of the slots it writes are read first,
and where a shard refuses its rows, the shards that wrote theirs get their old rows back before
the error is raised.
"""

from __future__ import annotations

import multiprocessing as mp
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

Factory = Callable[..., Any]
"""``make(num_slots, first_slot=first)``: a shard's simulator, whose slot ``j`` is the whole
simulator's slot ``first + j`` (a factory that maps slots onto tasks needs the offset)."""


@dataclass(frozen=True)
class PositionFree:
    """A :data:`Factory` of a simulator whose slots do not depend on where they stand (every slot
    runs the same task): ``make(num_slots)`` called without the shard's first slot, e.g.
    ``PositionFree(functools.partial(MujocoPush, cfg=cfg))``. Picklable where ``make`` is."""

    make: Callable[[int], Any]

    def __call__(self, num_slots: int, first_slot: int = 0) -> Any:
        return self.make(num_slots)


ATTRIBUTES = (
    "instructions",
    "num_cameras",
    "image_size",
    "action_dim",
    "proprio_dim",
    "observation_dim",
    "observation_bound",
    "state_nbytes",
)
"""The protocol's data members, read from the first shard (every shard must agree)."""

OPTIONAL = ("pretrained_weights",)
"""Data members a simulator may have (the policy trained for it), forwarded where the shards have them."""


def _serve(conn: Connection, make: Factory, num_slots: int, first_slot: int) -> None:
    """A worker's loop: make the shard, report its attributes and identity, then run the calls
    ``(method, args)`` it is sent and send back ``("ok", result)`` or ``("error", exception)``.
    Torch's intra-op pool is one thread here: the processes are the parallelism, and workers each
    spinning a pool the size of the machine oversubscribe the cores (a shard's torch renderer ran
    10x slower so)."""
    import torch

    torch.set_num_threads(1)
    try:
        sim = make(num_slots, first_slot=first_slot)
        attrs = {name: getattr(sim, name) for name in ATTRIBUTES}
        attrs |= {name: getattr(sim, name) for name in OPTIONAL if hasattr(sim, name)}
        conn.send(("ok", (attrs, sim.identity())))
    except Exception as e:  # the parent raises it with the shard named
        conn.send(("error", e))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent is gone
            return
        if method is None:
            return
        try:
            conn.send(("ok", getattr(sim, method)(*args)))
        except Exception as e:
            conn.send(("error", e))


def _stop(conns: list[Connection], procs: list[mp.process.BaseProcess]) -> None:
    """Ask every worker to end, then make sure it has (what :meth:`Processes.close` and the
    finaliser run)."""
    for c in conns:
        try:
            c.send((None, ()))
        except (BrokenPipeError, EOFError, OSError):
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()


class Processes:
    """:class:`~flashrt_gym.simulator.ExternalSimulator` over ``processes`` worker processes,
    each stepping a contiguous shard of the slots with its own simulator from ``make``.

    Args:
        make: ``make(num_slots, first_slot=...)`` -> a shard's simulator (:data:`Factory`);
            picklable (a module-level class or function, or a ``functools.partial`` of one), since
            the workers are spawned.
        num_slots: slots in all.
        processes: worker processes (at most ``num_slots``; shards differ by at most one slot).

    Raises:
        ValueError: bad counts, or shards that disagree on their attributes or identity.
        Exception: a shard's own error where it failed to start, with the shard named.
    """

    def __init__(self, make: Factory, num_slots: int, processes: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= num_slots:
            raise ValueError(
                f"processes must be an int in [1, num_slots={num_slots}] (e.g. the host's cores), got {processes!r}"
            )
        self.num_slots = num_slots
        self.bounds = np.linspace(0, num_slots, processes + 1).round().astype(np.int64)
        """Shard ``w`` holds slots ``bounds[w]`` to ``bounds[w + 1] - 1``."""
        self._shard_of = np.repeat(np.arange(processes), np.diff(self.bounds))
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        for w in range(processes):
            mine, theirs = ctx.Pipe()
            first, count = int(self.bounds[w]), int(self.bounds[w + 1] - self.bounds[w])
            p = ctx.Process(target=_serve, args=(theirs, make, count, first), daemon=True, name=f"flashrt-shard-{w}")
            p.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(p)
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs)
        try:
            ready = self._gather(list(range(processes)), [None] * processes)
        except Exception:
            self.close()
            raise
        (attrs, ident), rest = ready[0], ready[1:]
        for w, (a, i) in enumerate(rest, start=1):
            if a != attrs or i != ident:
                self.close()
                raise ValueError(
                    f"shard {w}'s simulator differs from shard 0's ({a}, {i!r} vs {attrs}, {ident!r}); make(num_slots, "
                    "first_slot=...) must build the same simulator for every shard"
                )
        for name, value in attrs.items():
            setattr(self, name, value)
        self._identity = ident

    @property
    def processes(self) -> int:
        """Worker processes (shards)."""
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, in shard order (to watch their memory and load)."""
        return [int(p.pid) for p in self._procs]

    def close(self) -> None:
        """End the workers (also done when the simulator is collected or the process exits)."""
        self._finalizer()

    # -- plumbing ------------------------------------------------------------------------------
    def _exchange(self, shards: list[int], calls: list[tuple[str, tuple] | None]) -> list[tuple[str, Any]]:
        """Send each shard its call (None: only read its start-up report), then read every answer,
        ``(status, value)`` in shard order: all shards work at once, and no reply is left in a pipe."""
        for w, call in zip(shards, calls, strict=True):
            if call is not None:
                self._send(w, call)
        return [self._receive(w) for w in shards]

    def _gather(self, shards: list[int], calls: list[tuple[str, tuple] | None]) -> list[Any]:
        """:meth:`_exchange`'s results; the first failure raised, with its shard and slots named."""
        answers = self._exchange(shards, calls)
        for w, (status, value) in zip(shards, answers, strict=True):
            if status == "error":
                raise self._named(w, value)
        return [value for _, value in answers]

    def _receive(self, w: int) -> tuple[str, Any]:
        try:
            return self._conns[w].recv()
        except (EOFError, OSError):
            raise self._died(w) from None

    def _died(self, w: int) -> RuntimeError:
        """Shard ``w``'s worker is gone: end the others too (their replies to the call in flight
        would be read as the next call's) and name the cause."""
        p = self._procs[w]
        p.join(timeout=5)
        self.close()
        return RuntimeError(
            f"shard {w}'s worker process died (exit code {p.exitcode}); every worker has been ended: make a new "
            "simulator (and restore its slots from a capsule)"
        )

    def _named(self, w: int, error: BaseException) -> BaseException:
        """``error`` of shard ``w``, its message prefixed with the shard and its slots (slot indices
        in the message are the shard's own, counted from its first slot)."""
        a, b = int(self.bounds[w]), int(self.bounds[w + 1]) - 1
        message = f"shard {w} (slots {a} to {b}; a slot index in its message counts from {a}): {error}"
        try:
            named = type(error)(message)
        except Exception:  # an exception type that takes other arguments
            named = RuntimeError(message)
        named.__cause__ = error
        return named

    def _send(self, w: int, call: tuple[str, tuple]) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this simulator's worker processes have been ended (close()); make a new one")
        try:
            self._conns[w].send(call)
        except (BrokenPipeError, OSError):
            raise self._died(w) from None

    def _all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every shard; the results in shard order."""
        shards = list(range(self.processes))
        return self._gather(shards, [(method, args)] * len(shards))

    def _split(self, slots: Any) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """The global slot indices ``slots`` (all if None) and, per shard holding any, the
        positions in ``slots`` of that shard's ones."""
        s = np.arange(self.num_slots) if slots is None else np.asarray(slots)
        if s.ndim != 1 or (s.size and s.dtype.kind not in "iu"):
            raise ValueError(f"slots must be a 1-D sequence of slot indices, got {s.dtype} {s.shape}")
        s = s.astype(np.int64)
        if s.size and (s.min() < 0 or s.max() >= self.num_slots or len(set(s.tolist())) != s.size):
            raise ValueError(f"slot indices must be distinct and lie in [0, {self.num_slots}), got {s.tolist()}")
        owner = self._shard_of[s]
        return s, {int(w): np.flatnonzero(owner == w) for w in np.unique(owner)}

    # -- the protocol --------------------------------------------------------------------------
    def identity(self) -> str:
        """The shards' simulator's identity (state rows move between any slots of like shards)."""
        return self._identity

    def seed(self, seeds: Any, slots: Any = None) -> None:
        """Restart each slot's stream from its seed (every shard's slots at once)."""
        s, parts = self._split(slots)
        k = np.asarray(seeds)
        if k.shape != (s.size,):
            raise ValueError(f"seeds must be {s.size} integers, one per slot, got {k.dtype} {k.shape}")
        shards = list(parts)
        self._gather(shards, [("seed", (k[parts[w]], s[parts[w]] - self.bounds[w])) for w in shards])

    def reset(self, mask: Any = None) -> None:
        """Draw the next episode of each masked slot (all if None)."""
        if mask is None:
            self._all("reset", None)
            return
        m = np.asarray(mask, dtype=bool)
        if m.shape != (self.num_slots,):
            raise ValueError(f"mask must have shape ({self.num_slots},), got {m.shape}")
        shards = list(range(self.processes))
        self._gather(shards, [("reset", (m[self.bounds[w] : self.bounds[w + 1]],)) for w in shards])

    def run_ticks(self, actions: Any) -> tuple[np.ndarray, np.ndarray]:
        """Advance every slot ``T`` ticks under ``actions (slots, T, action_dim)``: the shards'
        summed (dense, sparse) rewards, joined."""
        a = np.asarray(actions)
        if a.ndim < 1 or a.shape[0] != self.num_slots:
            raise ValueError(f"actions must have the slots first ({self.num_slots}, T, action_dim), got {a.shape}")
        shards = list(range(self.processes))
        out = self._gather(shards, [("run_ticks", (a[self.bounds[w] : self.bounds[w + 1]],)) for w in shards])
        return np.concatenate([d for d, _ in out]), np.concatenate([s for _, s in out])

    def set_instruction(self, index: int, slots: Any = None) -> None:
        """Give ``slots`` (all if None) the instruction ``index``."""
        s, parts = self._split(slots)
        shards = list(parts)
        self._gather(shards, [("set_instruction", (index, s[parts[w]] - self.bounds[w])) for w in shards])

    def success(self) -> np.ndarray:
        """(slots,) bool."""
        return np.concatenate(self._all("success"))

    def instruction(self) -> np.ndarray:
        """(slots,) int64."""
        return np.concatenate(self._all("instruction"))

    def render(self) -> np.ndarray:
        """(slots, num_cameras, H, W, 3) uint8."""
        return np.concatenate(self._all("render"))

    def proprio(self) -> np.ndarray:
        """(slots, proprio_dim) float32."""
        return np.concatenate(self._all("proprio"))

    def observation(self) -> np.ndarray:
        """(slots, observation_dim) float32."""
        return np.concatenate(self._all("observation"))

    def get_state(self, slots: Any = None) -> np.ndarray:
        """(len(slots), state_nbytes) uint8 rows of ``slots`` (all if None), in their order."""
        s, parts = self._split(slots)
        out = np.empty((s.size, self.state_nbytes), dtype=np.uint8)
        shards = list(parts)
        rows = self._gather(shards, [("get_state", (s[parts[w]] - self.bounds[w],)) for w in shards])
        for w, r in zip(shards, rows, strict=True):
            out[parts[w]] = r
        return out

    def set_state(self, slots: Any, states: Any) -> None:
        """Write rows into ``slots`` (all if None), all or nothing across the shards.

        Raises:
            ValueError: rows of the wrong shape, or a row a shard refuses (then no slot changed).
        """
        s, parts = self._split(slots)
        rows = np.asarray(states)
        if rows.dtype != np.uint8 or rows.shape != (s.size, self.state_nbytes):
            raise ValueError(
                f"states must be uint8 of shape ({s.size}, {self.state_nbytes}) (rows of get_state), got "
                f"{rows.dtype} {rows.shape}"
            )
        if len(parts) == 1:  # one shard: its own set_state is all-or-nothing
            ((w, pos),) = parts.items()
            self._gather([w], [("set_state", (s[pos] - self.bounds[w], rows[pos]))])
            return
        before = self.get_state(s)
        shards = list(parts)
        calls = [("set_state", (s[parts[w]] - self.bounds[w], rows[parts[w]])) for w in shards]
        answers = self._exchange(shards, calls)
        failed = [(w, value) for w, (status, value) in zip(shards, answers, strict=True) if status == "error"]
        if failed:
            wrote = [w for w in shards if w not in dict(failed)]
            self._gather(wrote, [("set_state", (s[parts[w]] - self.bounds[w], before[parts[w]])) for w in wrote])
            raise self._named(*failed[0])
