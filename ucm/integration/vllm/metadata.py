"""The message the scheduler half sends the worker half every step.

It is a plain dataclass of lists (no tensors, no callables) so that vLLM can
serialize it between the scheduler process and the worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ucm.store.base import BlockKey


@dataclass
class BlockLoad:
    """Load one block from a tier into the paged KV buffer."""

    block_id: int
    """Destination block in vLLM's paged buffer."""
    key: BlockKey
    """The block's key (the worker derives its shard key from it)."""
    tier: int
    """Index of the tier to read first; the worker falls back to the other tiers."""
    promote_to: tuple[int, ...] = ()
    """Tiers to copy the block into once it has been read."""


@dataclass
class BlockSave:
    """Save one block from the paged KV buffer into tiers."""

    block_id: int
    """Source block in vLLM's paged buffer."""
    key: BlockKey
    """The block's key."""
    tiers: tuple[int, ...]
    """Indices of the tiers to write."""
    request_id: str = ""
    """The request that computed the block."""


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    """Everything the worker half does in one step, in the order it does it."""

    evictions: dict[int, list[BlockKey]] = field(default_factory=dict)
    """Per tier, keys to delete before anything else (tiers the scheduler manages)."""
    loads: list[BlockLoad] = field(default_factory=list)
    """Blocks to load before the forward pass."""
    saves: list[BlockSave] = field(default_factory=list)
    """Blocks to save once the forward pass has written them."""
    failure_epoch: int = 0
    """How many steps' failed loads the scheduler had been told of when it planned
    this step: steps planned before it knew of a failure do not reset the requests
    that computed on the failed blocks."""
    tables: dict[str, list[int]] = field(default_factory=dict)
    """Per request with saves, the blocks its saved blocks were computed from: a save
    is dropped when any of them failed to load."""
    async_loads: dict[str, list[BlockLoad]] = field(default_factory=dict)
    """Per request waiting for its KV, blocks to load in the background; the worker
    reports the request through ``get_finished`` once they are in place."""
    sending: list[str] = field(default_factory=list)
    """Requests whose saves this step are written to persistent tiers straight from
    their KV pages in the background (``async_save``)."""
    preempted: list[str] = field(default_factory=list)
    """Requests of ``sending`` that vLLM preempted: their pages may be reused only once
    their writes are done."""
    release: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM keeps until the worker reports them through
    ``get_finished`` (finished sending), once their writes from the pages are done."""

    def is_empty(self) -> bool:
        """Return whether the step has nothing for the worker to do."""
        return not (self.evictions or self.loads or self.saves or self.async_loads or self.release)
