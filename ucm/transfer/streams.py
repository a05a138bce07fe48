"""Copy streams: where the worker's copies between KV pages and staging memory run.

On an accelerator (CUDA or ROCm, XPU, any device with torch streams) the worker issues
its page gathers, page scatters and device/host copies on a stream of its own, so they
overlap the forward pass, and orders them with events instead of host waits:

- a copy that reads pages the forward pass writes is issued after
  :meth:`CopyStream.follow_compute`;
- the forward pass waits for copies that write pages it reads
  (:meth:`CopyStream.make_compute_wait`: the compute stream waits, the host does not);
- the host waits for an event (:meth:`CopyEvent.synchronize`) only where it touches
  staging memory the stream copies to or from: before a store reads saved rows, and
  before rows are handed out again.

On the CPU the same calls run each copy at once in the calling thread, and every event
is complete when it is recorded: the CPU path is the same code with a stream that
never lags.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Protocol, cast

import torch


class CopyEvent(Protocol):
    """A point in a copy stream: the copies issued before it."""

    def synchronize(self) -> None:
        """Block the calling thread until every copy issued before this event finished."""


class _Complete:
    """The event of a stream that runs every copy at once: always reached."""

    def synchronize(self) -> None:
        """Return at once: the copies already ran."""


COMPLETE: CopyEvent = _Complete()
"""An event that has always been reached (nothing to wait for)."""


class CopyStream(abc.ABC):
    """An ordered queue of copies, running alongside the forward pass."""

    @abc.abstractmethod
    def follow_compute(self) -> None:
        """Order this stream's next copies after all work issued to the compute stream
        so far (the copies read what the forward pass wrote)."""

    @abc.abstractmethod
    def run(self, copy: Callable[[], None]) -> None:
        """Issue ``copy`` on this stream: the tensor operations it makes are queued on it.

        Args:
            copy: Makes the copies; the tensors it uses must stay alive and unchanged
                until an event recorded after it is reached.
        """

    @abc.abstractmethod
    def record(self) -> CopyEvent:
        """Return an event reached once every copy issued so far has finished."""

    @abc.abstractmethod
    def make_compute_wait(self, event: CopyEvent) -> None:
        """Make the compute stream's next work wait for ``event``, without blocking the host.

        Args:
            event: An event recorded on this stream.
        """


class HostStream(CopyStream):
    """The CPU's stream: each copy runs at once in the calling thread."""

    def follow_compute(self) -> None:
        """Do nothing: the forward pass's work before this call has already run."""

    def run(self, copy: Callable[[], None]) -> None:
        """Run ``copy`` now."""
        copy()

    def record(self) -> CopyEvent:
        """Return :data:`COMPLETE`: every copy issued so far has run."""
        return COMPLETE

    def make_compute_wait(self, event: CopyEvent) -> None:
        """Do nothing: the copies ran before the forward pass continues."""


class DeviceStream(CopyStream):
    """A torch stream of an accelerator, ordered against its current (compute) stream."""

    def __init__(self, device: torch.device) -> None:
        """Create the stream.

        Args:
            device: The accelerator holding the KV cache.
        """
        self._device = device
        self._stream = torch.Stream(device=device)

    def follow_compute(self) -> None:
        """Make this stream wait for the work issued so far to the compute stream."""
        self._stream.wait_stream(self._compute())

    def run(self, copy: Callable[[], None]) -> None:
        """Call ``copy`` with this stream current, so its operations queue on it."""
        with self._stream:
            copy()

    def record(self) -> CopyEvent:
        """Record an event on this stream."""
        return cast(CopyEvent, self._stream.record_event())

    def make_compute_wait(self, event: CopyEvent) -> None:
        """Make the compute stream wait for ``event`` (a torch event of this stream)."""
        self._compute().wait_event(cast(torch.Event, event))

    def _compute(self) -> torch.Stream:
        return torch.accelerator.current_stream(self._device)


def copy_stream(device: torch.device) -> CopyStream:
    """Return the copy stream for KV tensors on ``device``.

    Args:
        device: Where vLLM's KV cache lives.

    Returns:
        A :class:`HostStream` for the CPU, else a :class:`DeviceStream`.
    """
    return HostStream() if device.type == "cpu" else DeviceStream(device)
