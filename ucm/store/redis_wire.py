"""The Redis protocol (RESP2) pieces of the ``redis`` backend that move values without copies.

redis-py builds every value into one ``bytes`` object on the way out (its ``hiredis``
packer copies each argument into one command buffer) and hands each reply back as a
new ``bytes`` object. For KV blocks of megabytes these copies cost more than the
network on loopback. :class:`SegmentedSerializer` sends a value made of several
buffers (vLLM's KV pages, then the trailer) to the socket as they are, and
:class:`ReplyReader` reads pipelined ``GET`` replies from the socket straight into the
caller's buffers.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from redis.connection import PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from ucm.store.base import Buffer

BUFFER_CUTOFF = 6000
"""redis-py's: arguments larger than this are sent as pieces of their own."""
_READ_BYTES = 64 << 10  # Bytes asked of the socket per read for reply headers.


class Segmented:
    """A value whose bytes are the concatenation of buffers and a short tail."""

    __slots__ = ("chunks", "nbytes", "tail")

    def __init__(self, chunks: Sequence[Buffer], tail: bytes) -> None:
        """Describe the value.

        Args:
            chunks: The buffers, in order; they must stay unchanged until it is sent.
            tail: Bytes after them (the trailer).
        """
        self.chunks = [chunk.cast("B") for chunk in chunks]
        self.tail = tail
        self.nbytes = sum(chunk.nbytes for chunk in self.chunks) + len(tail)


def encode(value: bytes | memoryview | str | int | float) -> bytes | memoryview:
    """Encode one command argument as redis-py does (``decode_responses`` off)."""
    if isinstance(value, bytes | memoryview):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"redis backend: cannot send a {type(value).__name__} argument")


class SegmentedSerializer(PythonRespSerializer):
    """redis-py's command packer, which also sends a :class:`Segmented` value's buffers
    to the socket as they are, without joining them into one object."""

    def __init__(self) -> None:
        """Pack like redis-py's pure-Python packer for every other argument."""
        super().__init__(BUFFER_CUTOFF, encode)

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        """Return the pieces of one command in the Redis protocol."""
        if not any(isinstance(arg, Segmented) for arg in args):
            return list(super().pack(*args))  # type: ignore[no-untyped-call]
        pieces: list[bytes | memoryview] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, Segmented):
                pieces += [head + b"$%d\r\n" % arg.nbytes, *arg.chunks]
                head = arg.tail + b"\r\n"
            else:
                data = encode(arg)
                head += b"$%d\r\n%s\r\n" % (len(data), data)
        return [*pieces, head]


class ReplyReader:
    """Reads RESP2 replies from a connected socket, bulk strings into caller buffers.

    Only for a connection whose replies nobody else reads meanwhile; it must read
    every reply to the commands sent, so that the connection stays in step.
    """

    def __init__(self, sock: socket.socket) -> None:
        """Read from ``sock`` (blocking, with the connection's timeout)."""
        self._sock = sock
        self._buffer = bytearray()

    def read_value(self, segments: Sequence[Buffer], tail: Buffer) -> int | bytes | None:
        """Read the reply to one ``GET``.

        A value exactly as long as ``segments`` and ``tail`` together is read into them,
        in order; a value of any other length is returned whole.

        Args:
            segments: Writable buffers for the value's start.
            tail: A writable buffer for its end (the trailer).

        Returns:
            The length read into the buffers (an ``int``), the value (``bytes``) when
            its length differs, or None for a missing key.

        Raises:
            ResponseError: The server answered with an error.
            redis.exceptions.ConnectionError: The connection closed, or the reply is
                not a bulk string.
            OSError: The socket failed or timed out.
        """
        line = self._line()
        if line == b"_":  # RESP3's null, should a server answer in it.
            return None
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise RedisConnectionError(f"unexpected reply to GET: {line[:40]!r}")
        length = int(line[1:])
        if length < 0:
            return None
        expected = sum(segment.nbytes for segment in segments) + tail.nbytes
        if length == expected:
            for segment in segments:
                self._read_into(segment.cast("B"))
            self._read_into(tail.cast("B"))
        else:
            value = bytearray(length)
            self._read_into(memoryview(value))
        if self._line():
            raise RedisConnectionError("a bulk string did not end with CRLF")
        return length if length == expected else bytes(value)

    def _line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            chunk = self._sock.recv(_READ_BYTES)
            if not chunk:
                raise RedisConnectionError("the server closed the connection")
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _read_into(self, target: memoryview) -> None:
        taken = min(len(self._buffer), target.nbytes)
        target[:taken] = self._buffer[:taken]
        del self._buffer[:taken]
        while taken < target.nbytes:
            count = self._sock.recv_into(target[taken:])
            if not count:
                raise RedisConnectionError("the server closed the connection")
            taken += count
