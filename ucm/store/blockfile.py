"""The on-disk format of one stored block, shared by the ``posix`` backend and ``ucm fsck``.

A block file is the payload followed by a 64-byte trailer::

    digest (16) | key, zero-padded (32) | payload length (u64) | key length (u8) |
    flags (u8) | format version (u16) | magic ``UCMB`` (4)

The digest covers the payload and the rest of the trailer, so a flipped bit anywhere,
a block renamed to another key, or a file cut short is detected on load. It is an
xxh3-128 checksum, or, where the store has a secret key, a keyed BLAKE3 MAC (flag
:data:`SIGNED`) that a writer without the key cannot forge. Putting the metadata last
keeps the payload at offset 0, where aligned (``O_DIRECT``) transfers can reach it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash
from blake3 import blake3

from ucm.store.base import BlockKey, Buffer

FORMAT_VERSION = 2
"""Version written in every trailer; files of other versions are not read."""
MAGIC = b"UCMB"
MAX_KEY_BYTES = 32
"""The longest key a trailer can hold."""
DIGEST_BYTES = 16
_TRAILER = struct.Struct(f"<{DIGEST_BYTES}s{MAX_KEY_BYTES}sQBBH4s")
TRAILER_BYTES = _TRAILER.size
"""Size of the trailer that follows every payload (64)."""
MIN_SECRET_BYTES = 16
"""The shortest signing secret accepted."""
SIGNED = 0x01
"""Trailer flag: the digest is a keyed MAC, not a plain checksum."""
_KNOWN_FLAGS = SIGNED
_KEY_CONTEXT = "ucm 2026-11 block signing key"


@dataclass(frozen=True)
class Trailer:
    """The metadata stored after a block's payload."""

    key: BlockKey
    """The key the block was stored under."""
    length: int
    """Payload bytes before the trailer."""
    flags: int
    """Bit set of :data:`SIGNED`."""
    digest: bytes
    """Checksum or MAC of the payload and the rest of the trailer."""

    def pack(self) -> bytes:
        """Return the 64 bytes that end the block file."""
        return self._packed(self.digest)

    def unsigned_part(self) -> bytes:
        """Return the trailer bytes the digest covers (all but the digest itself)."""
        return self._packed(b"")[DIGEST_BYTES:]

    def _packed(self, digest: bytes) -> bytes:
        return _TRAILER.pack(
            digest, self.key, self.length, len(self.key), self.flags, FORMAT_VERSION, MAGIC
        )


def parse_trailer(raw: bytes | bytearray | memoryview) -> Trailer | None:
    """Decode a trailer; return None unless it is well formed for this format version.

    Args:
        raw: Exactly :data:`TRAILER_BYTES` bytes.
    """
    if len(raw) != TRAILER_BYTES:
        return None
    digest, padded, length, key_length, flags, version, magic = _TRAILER.unpack(raw)
    if magic != MAGIC or version != FORMAT_VERSION or flags & ~_KNOWN_FLAGS:
        return None
    if key_length > MAX_KEY_BYTES or any(padded[key_length:]):
        return None
    return Trailer(BlockKey(bytes(padded[:key_length])), length, flags, bytes(digest))


class Sealer:
    """Computes and checks block digests: checksums, or MACs when given a secret."""

    def __init__(self, secret: bytes | None = None) -> None:
        """Set up sealing.

        Args:
            secret: The store's secret (any length, at least 16 bytes); None for plain
                checksums.

        Raises:
            ValueError: The secret is shorter than 16 bytes.
        """
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a signing secret needs {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._mac_key: bytes | None = None
        if secret is not None:
            self._mac_key = blake3(secret, derive_key_context=_KEY_CONTEXT).digest()
        self.flags = 0 if secret is None else SIGNED
        """Flags of the trailers this sealer writes."""

    def seal(self, key: BlockKey, payload: Sequence[Buffer]) -> Trailer:
        """Return the trailer to store after ``payload`` under ``key``.

        Args:
            key: The block's key (at most :data:`MAX_KEY_BYTES` bytes).
            payload: The payload's segments, in order.

        Raises:
            ValueError: The key is too long.
        """
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"keys are at most {MAX_KEY_BYTES} bytes, got {key!r}")
        length = sum(segment.nbytes for segment in payload)
        draft = Trailer(key, length, self.flags, b"")
        return Trailer(key, length, self.flags, self._digest(draft, payload))

    def verify(self, trailer: Trailer, payload: Sequence[Buffer]) -> bool:
        """Return whether ``payload`` and ``trailer`` are what this sealer wrote.

        A signed block is refused without the secret, and an unsigned one with it.

        Args:
            trailer: The trailer read from the block file.
            payload: The payload read from it.
        """
        if trailer.flags != self.flags:
            return False
        return self._digest(trailer, payload) == trailer.digest

    def open(self, key: BlockKey, value: Buffer, verify: bool = True) -> Buffer | None:
        """Return the payload of a value stored as payload then trailer (remote stores).

        Args:
            key: The key the value was read under.
            value: The whole value.
            verify: Check the payload against its checksum; without it only the trailer
                is checked (a MAC is always checked).

        Returns:
            A view of the payload, or None unless the value is whole, the key's, and
            (where checked) intact.
        """
        size = value.nbytes - TRAILER_BYTES
        if size < 0:
            return None
        payload = value[:size]
        return payload if self.check(key, value[size:], [payload], verify) else None

    def check(
        self, key: BlockKey, trailer: Buffer | bytes, payload: Sequence[Buffer], verify: bool
    ) -> bool:
        """Return whether a payload and the trailer stored after it are whole and the key's.

        Args:
            key: The key they were read under.
            trailer: The :data:`TRAILER_BYTES` that followed the payload.
            payload: The payload's segments, as read.
            verify: Check the payload against its checksum; without it only the trailer
                is checked (a MAC is always checked).
        """
        parsed = parse_trailer(trailer)
        size = sum(segment.nbytes for segment in payload)
        if parsed is None or parsed.key != key or parsed.length != size:
            return False
        checked = verify or self.flags or parsed.flags != self.flags
        return not checked or self.verify(parsed, payload)

    def _digest(self, trailer: Trailer, payload: Sequence[Buffer]) -> bytes:
        hasher: xxhash.xxh3_128 | blake3
        hasher = xxhash.xxh3_128() if self._mac_key is None else blake3(key=self._mac_key)
        for segment in payload:
            hasher.update(segment)
        hasher.update(trailer.unsigned_part())
        return hasher.digest()[:DIGEST_BYTES]


def read_secret(options: Mapping[str, object], backend: str) -> bytes | None:
    """Return the signing secret named by a tier's ``secret_file`` or ``secret_env``.

    The secret itself never appears in the configuration (which is logged).

    Args:
        options: The tier's options.
        backend: The backend's name, for error messages.

    Raises:
        ValueError: Both options are given, or the file or variable is missing or empty.
    """
    file, env = options.get("secret_file"), options.get("secret_env")
    if file is not None and env is not None:
        raise ValueError(f"{backend} backend: give 'secret_file' or 'secret_env', not both")
    if file is not None:
        try:
            secret = Path(str(file)).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{backend} backend: secret_file {str(file)!r}: {exc}") from exc
        where = f"secret_file {str(file)!r}"
    elif env is not None:
        secret = os.environ.get(str(env), "").encode()
        where = f"secret_env: environment variable {env!r}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{backend} backend: {where} holds {len(secret)} bytes, fewer than 16")
    return secret
