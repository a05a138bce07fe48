"""KV events for KV-aware routers: which prefixes an instance can serve through ucm.

When vLLM's KV events are on (``--kv-events-config``), the scheduler half reports a
``BlockStored`` event for each block it sends to ucm's tiers and a ``BlockRemoved``
event for each block it evicts from a tier it manages (``dram``); vLLM publishes them
with its own events. Blocks are named by vLLM's own block hashes, so a router matches
them like vLLM's prefix-cache events; ``medium`` tells where they live: ``CPU`` for an
in-memory tier, ``STORAGE`` for disk and remote stores. Blocks other processes remove
from a shared store are not reported (no one process sees them go).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from ucm.store.base import BlockKey

if TYPE_CHECKING:
    from vllm.v1.request import Request


class KVEvents:
    """Collects the scheduler half's KV events until vLLM takes them."""

    def __init__(self, block_size: int, media: Sequence[str]) -> None:
        """Set up the event log.

        Args:
            block_size: vLLM's KV block size in tokens.
            media: Each tier's medium (``memory``, ``disk``, ``remote``), fastest first.
        """
        self._block_size = block_size
        self._media = [MEDIUM_CPU if medium == "memory" else MEDIUM_STORAGE for medium in media]
        self._events: list[KVCacheEvent] = []
        # vLLM's hash of each block held by an in-memory tier, to name it on eviction.
        self._hashes: dict[tuple[int, BlockKey], bytes] = {}

    def stored(self, request: Request, index: int, key: BlockKey, tiers: Sequence[int]) -> None:
        """Record that block ``index`` of ``request`` goes to ``tiers``.

        Args:
            request: The request that computed the block.
            index: The block's position in the request.
            key: ucm's key of the block.
            tiers: The tiers it is written to.
        """
        hashes = request.block_hashes
        if index >= len(hashes):
            return  # vLLM hashes blocks at another granularity: nothing to name it by.
        block_hash = hashes[index]
        parent = maybe_convert_block_hash(hashes[index - 1]) if index else None
        start = index * self._block_size
        lora = request.lora_request
        for medium in dict.fromkeys(self._media[tier] for tier in tiers):
            self._events.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(block_hash)],
                    parent_block_hash=parent,
                    token_ids=list(request.all_token_ids[start : start + self._block_size]),
                    block_size=self._block_size,
                    lora_id=lora.adapter_id if lora else None,
                    medium=medium,
                    lora_name=lora.name if lora else None,
                )
            )
        for tier in tiers:
            if self._media[tier] == MEDIUM_CPU:
                self._hashes[(tier, key)] = block_hash

    def removed(self, tier: int, keys: Sequence[BlockKey]) -> None:
        """Record that an in-memory tier evicted ``keys``."""
        hashes = [self._hashes.pop((tier, key), None) for key in keys]
        known = [maybe_convert_block_hash(h) for h in hashes if h is not None]
        if known:
            self._events.append(BlockRemoved(block_hashes=known, medium=self._media[tier]))

    def take(self) -> list[KVCacheEvent]:
        """Return the events recorded since the last call."""
        events, self._events = self._events, []
        return events
