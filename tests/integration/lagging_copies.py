"""Runs the worker's staging copies on a :class:`LaggingStream`, which runs each copy
only when an event forces it: the CPU stand-in for a GPU copy stream that runs late.

Imported into an engine process (``EngineSpec.imports``). At exit it prints how many
copies ran late, so a test can tell the stream was used. Two environment variables
break the ordering on purpose, for negative controls:

- ``UCM_TEST_COMPUTE_WAITS=0``: the forward pass does not wait for loaded pages;
- ``UCM_TEST_WRITES_WAIT=0``: background writes do not wait for their staged pages.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable

import torch

from ucm.integration.vllm import worker
from ucm.testing.streams import LaggingStream
from ucm.transfer.streams import CopyStream
from ucm.transfer.writer import BackgroundWriter

_streams: list[LaggingStream] = []


def _lagging(device: torch.device) -> CopyStream:
    stream = LaggingStream(compute_waits=os.environ.get("UCM_TEST_COMPUTE_WAITS") != "0")
    _streams.append(stream)
    return stream


@atexit.register
def _report() -> None:
    ran = sum(stream.ran for stream in _streams)
    print(f"ucm test: {ran} copies ran late on a lagging stream", file=sys.stderr, flush=True)


worker.copy_stream = _lagging  # type: ignore[assignment]

if os.environ.get("UCM_TEST_WRITES_WAIT") == "0":
    _write = BackgroundWriter._write

    def _write_at_once(
        backend: object, keys: object, payloads: object, ready: Callable[[], None] | None
    ) -> int:
        return _write(backend, keys, payloads, None)  # type: ignore[arg-type]

    BackgroundWriter._write = staticmethod(_write_at_once)  # type: ignore[method-assign,assignment]
