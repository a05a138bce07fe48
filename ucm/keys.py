"""Block keys: deterministic, chained content digests of token blocks.

A block's key covers every token from the start of the sequence to the end of that
block (each key hashes its parent key), and starts from a :class:`KeySpace` digest
that covers everything making stored KV bytes valid for a reader: model identity,
dtypes, block size, KV shape, parallel layout and the storage format version. Keys
use BLAKE2b, so they are identical across processes, restarts and machines, whatever
``PYTHONHASHSEED`` is.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ucm.store.base import BlockKey

FORMAT_VERSION = 1
"""Version of the stored block format; part of every key."""

KEY_BYTES = 32
"""Length of a block key in bytes."""


@dataclass(frozen=True)
class KeySpace:
    """Everything besides the tokens that decides whether stored KV is valid for a reader."""

    model_id: str
    """Model name or path (or the configured ``model_id``)."""
    revision: str
    """Model revision, empty when none."""
    architecture: str
    """Model architecture names, comma-separated."""
    dtype: str
    """Model dtype."""
    kv_cache_dtype: str
    """KV cache dtype (``auto`` or a quantized type)."""
    block_size: int
    """Tokens per KV block."""
    num_layers: int
    """Number of attention layers of the whole model."""
    num_kv_heads: int
    """Total KV heads (before tensor-parallel sharding)."""
    head_size: int
    """Head dimension."""
    use_mla: bool
    """Whether the model uses multi-head latent attention."""
    tensor_parallel_size: int
    """Tensor-parallel world size."""
    pipeline_parallel_size: int
    """Pipeline-parallel world size."""
    device: str
    """Device type whose attention backend wrote the pages (their layout differs)."""
    attention_backend: str
    """Configured attention backend, empty for the platform's default."""
    quantization: str
    """Weight quantization method, empty when none."""
    speculative: str
    """Speculative-decoding method and draft model (their layers' pages are stored too)."""
    model_config_digest: str
    """Digest of the model's configuration (rope scaling, overrides...), path excluded."""

    def root(self) -> bytes:
        """Return the digest every key chain of this key space starts from."""
        fields = {"format_version": FORMAT_VERSION, **asdict(self)}
        encoded = json.dumps(fields, sort_keys=True).encode()
        return hashlib.blake2b(encoded, digest_size=KEY_BYTES, person=b"ucm-keyspace").digest()


def request_root(space_root: bytes, extra: Sequence[str] = ()) -> bytes:
    """Derive the chain root for one request from the key space's root.

    Args:
        space_root: :meth:`KeySpace.root`.
        extra: Per-request identifiers that change the KV (LoRA name, cache salt).

    Returns:
        ``space_root`` itself when ``extra`` is empty, else a digest of both.
    """
    if not extra:
        return space_root
    payload = json.dumps(list(extra)).encode()
    return hashlib.blake2b(space_root + payload, digest_size=KEY_BYTES).digest()


def chain_keys(
    parent: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int
) -> list[BlockKey]:
    """Compute the keys of consecutive full blocks.

    Args:
        parent: The key of the block before the first one (or the chain root).
        token_ids: The tokens of these blocks, starting at the first block's first token.
        block_size: Tokens per block.
        num_blocks: How many blocks to compute; ``token_ids`` must hold them all.

    Returns:
        One key per block, each covering its parent and its own tokens.
    """
    if len(token_ids) < num_blocks * block_size:
        raise ValueError(f"{num_blocks} blocks need {num_blocks * block_size} tokens")
    keys: list[BlockKey] = []
    packed = array("q", token_ids[: num_blocks * block_size]).tobytes()
    width = block_size * 8
    blake2b = hashlib.blake2b
    for start in range(0, num_blocks * width, width):
        parent = blake2b(parent + packed[start : start + width], digest_size=KEY_BYTES).digest()
        keys.append(BlockKey(parent))
    return keys


def shard_key(key: BlockKey, shard: int, num_shards: int) -> BlockKey:
    """Return the key under which one parallel rank stores its shard of a block.

    Args:
        key: The block's key.
        shard: The rank's shard index (0-based).
        num_shards: How many shards the block is split into.

    Returns:
        ``key`` itself for an unsharded block, else a digest naming the shard.
    """
    if num_shards == 1:
        return key
    suffix = f"{shard}/{num_shards}".encode()
    return BlockKey(hashlib.blake2b(key + suffix, digest_size=KEY_BYTES).digest())


class KeyChain:
    """Incrementally computed keys of one token sequence's full blocks."""

    def __init__(self, root: bytes, block_size: int) -> None:
        self._root = root
        self._block_size = block_size
        self.keys: list[BlockKey] = []
        """Keys computed so far, one per full block from the start."""

    def extend(self, token_ids: Sequence[int], num_blocks: int | None = None) -> list[BlockKey]:
        """Compute keys for the full blocks of ``token_ids`` not computed yet.

        Args:
            token_ids: The whole sequence so far (it only ever grows).
            num_blocks: Stop after this many blocks (default: every full block).

        Returns:
            :attr:`keys` itself (not a copy), holding at least the requested blocks.
        """
        total = len(token_ids) // self._block_size
        if num_blocks is not None:
            total = min(total, num_blocks)
        done = len(self.keys)
        if total > done:
            parent = self.keys[-1] if self.keys else self._root
            start = done * self._block_size
            tokens = token_ids[start : total * self._block_size]
            self.keys.extend(chain_keys(parent, tokens, self._block_size, total - done))
        return self.keys
