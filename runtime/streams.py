"""Thin stream and event wrappers that work the same on CUDA and on the CPU.

On CUDA they wrap ``torch.cuda.Stream`` / ``torch.cuda.Event``. On the CPU work is synchronous,
so a stream is a no-op context and an event is complete as soon as it is recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType

import torch


class Stream:
    """An ordered queue of device work; ``with stream:`` makes it current.

    Args:
        device: the device whose work it orders.
        cuda_stream: wrap an existing ``torch.cuda.Stream`` instead of creating one.
    """

    def __init__(self, device: torch.device | str = "cpu", *, cuda_stream: torch.cuda.Stream | None = None) -> None:
        self.device = torch.device(device)
        self.cuda: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.cuda = cuda_stream or torch.cuda.Stream(self.device)
        self._ctx: contextlib.AbstractContextManager | None = None

    @classmethod
    def current(cls, device: torch.device | str = "cpu") -> Stream:
        """The stream that is current on ``device`` now (the CPU's null stream off CUDA)."""
        device = torch.device(device)
        if device.type == "cuda":
            return cls(device, cuda_stream=torch.cuda.current_stream(device))
        return cls(device)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""
        if self.cuda is not None and event.cuda is not None:
            self.cuda.wait_event(event.cuda)

    def __enter__(self) -> Stream:
        self._ctx = torch.cuda.stream(self.cuda) if self.cuda is not None else contextlib.nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        assert self._ctx is not None
        self._ctx.__exit__(et, ev, tb)
        self._ctx = None


class Event:
    """A point in a stream's work that other streams or the host can wait for."""

    def __init__(self, cuda_event: torch.cuda.Event | None = None) -> None:
        self.cuda = cuda_event

    @classmethod
    def record_on(cls, stream: Stream) -> Event:
        """Record a new event at the current end of ``stream``."""
        if stream.cuda is None:
            return cls()
        ev = torch.cuda.Event()
        ev.record(stream.cuda)
        return cls(ev)

    def synchronize(self) -> None:
        """Block the host until the event has completed."""
        if self.cuda is not None:
            self.cuda.synchronize()


@contextlib.contextmanager
def beside(stream: Stream | None, *reads: torch.Tensor | None) -> Iterator[Stream | None]:
    """Queue the block's work on ``stream`` after all the work queued so far on the current
    stream: a fork, which the caller joins with ``current.wait(Event.record_on(stream))``. With
    None the block runs in place, on the current stream.

    ``reads``: tensors allocated on the current stream that the block reads (None: skipped). Their
    memory is not handed out again before ``stream``'s work is done, however soon they are freed
    (``Tensor.record_stream``)."""
    if stream is None:
        yield None
        return
    stream.wait(Event.record_on(Stream.current(stream.device)))
    if stream.cuda is not None:
        for t in reads:
            if t is not None:
                t.record_stream(stream.cuda)
    with stream:
        yield stream
