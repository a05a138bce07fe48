"""Write-behind: bounded pending bytes, reads wait for their key, buffers released once."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ucm.store.base import BlockKey, CompletedTask, Segments, Task
from ucm.store.dram import DramBackend
from ucm.transfer.writer import BackgroundWriter

KEYS = [BlockKey(bytes([index]) * 32) for index in range(8)]


class GatedBackend(DramBackend):
    """A DRAM backend whose writes wait until the test opens a gate."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gate = threading.Event()

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        self.gate.wait(timeout=10)
        return super().dump(keys, payloads)


class FailingBackend(DramBackend):
    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        return CompletedTask([False] * len(keys))


def test_writes_complete_in_the_background_and_release_their_buffers() -> None:
    backend = GatedBackend()
    writer = BackgroundWriter(max_pending_bytes=1 << 20)
    released = threading.Event()
    payload = memoryview(bytearray(b"x" * 64))
    writer.submit(backend, KEYS[:1], [[payload]], released.set)
    assert not released.is_set() and backend.lookup(KEYS[:1]) == [False]
    backend.gate.set()
    writer.wait_for(KEYS[:1])  # A read of the key waits for its write.
    assert backend.lookup(KEYS[:1]) == [True]
    writer.flush()
    assert released.is_set()
    writer.close()


def test_submit_blocks_while_too_many_bytes_are_pending() -> None:
    backend = GatedBackend()
    writer = BackgroundWriter(max_pending_bytes=100)
    payload = memoryview(bytearray(64))
    writer.submit(backend, KEYS[:1], [[payload]], lambda: None)
    second = threading.Thread(
        target=writer.submit, args=(backend, KEYS[1:2], [[payload]], lambda: None)
    )
    second.start()
    second.join(timeout=0.2)
    assert second.is_alive(), "128 pending bytes exceed the bound of 100"
    backend.gate.set()
    second.join(timeout=5)
    assert not second.is_alive()
    writer.flush()
    assert backend.lookup(KEYS[:2]) == [True, True]
    writer.close()


def test_failed_writes_are_counted_and_still_release() -> None:
    writer = BackgroundWriter(max_pending_bytes=1 << 20)
    released = threading.Event()
    writer.submit(FailingBackend(1 << 20), KEYS[:3], [[memoryview(bytearray(8))]] * 3, released.set)
    writer.flush()
    assert released.is_set() and writer.failed_blocks == 3
    writer.close()
