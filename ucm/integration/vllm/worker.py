"""The worker half of the connector: moves blocks between vLLM's paged KV and the tiers.

It carries out the scheduler half's instructions and decides nothing about placement
or eviction. Per step: delete evicted blocks, load planned blocks into the paged
buffer before the forward pass (falling back to other tiers when a read fails),
copy saved blocks out per layer as the forward pass writes them, and write them to
their tiers before the step ends.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from ucm.config import TierConfig, UCMConfig
from ucm.integration.vllm.metadata import UCMConnectorMetadata
from ucm.integration.vllm.model_info import estimated_block_bytes, num_shards
from ucm.keys import shard_key
from ucm.store.base import Backend, BlockKey
from ucm.store.registry import backend_class
from ucm.transfer.paged import PagedKV, StagingPool, find_block_dim, row_buffers
from ucm.transfer.writer import BackgroundWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(f"vllm.{__name__}")  # Under vLLM's configured logger tree.


def _shard_index() -> int:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = get_tp_group()
    return int(get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group)


class UCMWorker:
    """Worker-side data path of :class:`UCMConnector`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: UCMConfig,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        """Remember the configuration; tiers open once the KV tensors are known.

        Args:
            vllm_config: The engine's configuration.
            config: ucm's parsed configuration.
            kv_cache_config: vLLM's KV cache layout, when the connector was given it.
        """
        self._vllm_config = vllm_config
        self._config = config
        self._kv_cache_config = kv_cache_config
        self._num_shards = num_shards(vllm_config)
        self._shard = _shard_index() if self._num_shards > 1 else 0
        self._paged: PagedKV | None = None
        self._tiers: list[Backend] = []
        self._staging: StagingPool | None = None
        self._save_rows: torch.Tensor | None = None  # This step's, until its writes finish.
        self._writer = BackgroundWriter(config.max_pending_write_bytes)
        self._meta = UCMConnectorMetadata()
        self._save_block_ids: torch.Tensor | None = None
        self._gathered: set[str] = set()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the KV tensors vLLM allocated and open the tiers."""
        context = self._vllm_config.compilation_config.static_forward_context
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        layers = []
        for name, tensor in kv_caches.items():
            backend = getattr(context.get(name), "attn_backend", None)
            layers.append((name, tensor, find_block_dim(tensor, backend, num_blocks)))
        self._paged = paged = PagedKV(layers)
        pin = paged.device.type == "cuda"
        self._staging = StagingPool(paged.block_bytes, pin)
        self._tiers = [self._open_tier(tier, paged.block_bytes) for tier in self._config.tiers]
        logger.info(
            "ucm: %d KV layers, %d bytes per block, tiers %s",
            len(paged.layers),
            paged.block_bytes,
            [tier.backend for tier in self._config.tiers],
        )

    def bind(self, meta: UCMConnectorMetadata) -> None:
        """Accept this step's instructions."""
        self._ensure_registered()
        self._meta = meta
        self._gathered = set()
        self._save_block_ids = None

    def clear(self) -> None:
        """Drop this step's instructions (and its staging rows, if nobody writes them)."""
        self._meta = UCMConnectorMetadata()
        self._save_block_ids = None
        if self._save_rows is not None and self._staging is not None:
            self._staging.release(self._save_rows)
        self._save_rows = None

    def start_load_kv(self) -> None:
        """Delete evicted blocks, then load this step's blocks into the paged buffer."""
        self._apply_evictions()
        loads = self._meta.loads
        if not loads or self._staging is None:
            return
        self._writer.wait_for([self._shard_key(load.key) for load in loads])
        staging = self._staging.acquire(len(loads))
        try:
            self._load(staging[: len(loads)])
        finally:
            self._staging.release(staging)

    def _load(self, rows: torch.Tensor) -> None:
        """Read this step's blocks into ``rows``, scatter them, then promote them."""
        assert self._paged is not None
        loads = self._meta.loads
        buffers = row_buffers(rows)
        ok = [False] * len(loads)
        by_tier: dict[int, list[int]] = defaultdict(list)
        for index, load in enumerate(loads):
            by_tier[load.tier].append(index)
        for tier, indices in by_tier.items():
            self._read(tier, indices, buffers, ok)
        for tier in range(len(self._tiers)):
            missing = [i for i, done in enumerate(ok) if not done and loads[i].tier != tier]
            if missing:
                self._read(tier, missing, buffers, ok)
        loaded = [index for index, done in enumerate(ok) if done]
        self._load_errors.update(
            load.block_id for load, done in zip(loads, ok, strict=True) if not done
        )
        if loaded:
            block_ids = torch.tensor([loads[i].block_id for i in loaded], device=self._paged.device)
            source = rows[loaded] if len(loaded) < len(loads) else rows
            for layer in self._paged.layers:
                self._paged.scatter(layer, block_ids, source)
        promotions: dict[int, list[int]] = defaultdict(list)
        for index in loaded:
            for tier in loads[index].promote_to:
                promotions[tier].append(index)
        for tier, indices in promotions.items():
            self._write(tier, indices, [loads[i].key for i in indices], buffers)

    def save_kv_layer(self, layer_name: str) -> None:
        """Copy this layer's pages of the blocks being saved, now that it wrote them."""
        saves = self._meta.saves
        if not saves or self._paged is None or self._staging is None:
            return
        layer = self._paged.layer(layer_name)
        if layer is None or layer_name in self._gathered:
            return
        if self._save_rows is None or self._save_block_ids is None:
            self._save_rows = self._staging.acquire(len(saves))
            ids = [save.block_id for save in saves]
            self._save_block_ids = torch.tensor(ids, device=self._paged.device)
        self._paged.gather(layer, self._save_block_ids, self._save_rows[: len(saves)])
        self._gathered.add(layer_name)

    def wait_for_save(self) -> None:
        """Finish copying saved blocks out, then write them to their tiers.

        In-memory tiers are written now; persistent tiers (disk, remote) in the
        background, from staging rows that stay reserved until their writes finish.
        The paged blocks themselves are free for vLLM to reuse when this returns.
        """
        saves = self._meta.saves
        if not saves or self._paged is None:
            return
        for layer in self._paged.layers:
            self.save_kv_layer(layer.name)
        self._apply_evictions()  # Before any write, whichever hook vLLM calls first.
        rows, self._save_rows = self._save_rows, None
        assert rows is not None and self._staging is not None
        buffers = row_buffers(rows[: len(saves)])
        by_tier: dict[int, list[int]] = defaultdict(list)
        for index, save in enumerate(saves):
            for tier in save.tiers:
                by_tier[tier].append(index)
        background = [t for t in by_tier if self._tiers[t].capabilities.persistent]
        for tier, indices in by_tier.items():
            if tier not in background:
                self._write(tier, indices, [saves[i].key for i in indices], buffers)
        self._meta = UCMConnectorMetadata()
        if not background:
            self._staging.release(rows)
            return
        remaining = [len(background)]
        lock = threading.Lock()
        pool = self._staging

        def release_when_all_done() -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    pool.release(rows)

        for tier in background:
            indices = by_tier[tier]
            keys = [self._shard_key(saves[i].key) for i in indices]
            chosen = [buffers[i] for i in indices]
            self._writer.submit(self._tiers[tier], keys, chosen, release_when_all_done)

    def fail_pending_loads(self) -> None:
        """Report every load of this step as failed (after an unexpected error)."""
        self._load_errors.update(load.block_id for load in self._meta.loads)

    def take_load_errors(self) -> set[int]:
        """Return and forget the block ids whose load failed."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self) -> None:
        """Block until every background write has finished."""
        self._writer.flush()

    def close(self) -> None:
        """Finish background writes, then close every tier."""
        self._writer.close()
        for tier in self._tiers:
            tier.close()
        self._tiers = []

    def _apply_evictions(self) -> None:
        """Delete the blocks the scheduler evicted this step (once per step).

        The scheduler sized this step's writes to fit after these deletions, so they
        must come first for the tiers to hold exactly what its mirror says.
        """
        for tier, keys in self._meta.evictions.items():
            self._tiers[tier].delete([self._shard_key(key) for key in keys])
        self._meta.evictions = {}

    def _ensure_registered(self) -> None:
        """Find the KV tensors in the forward context when nobody registered them."""
        if self._paged is not None:
            return
        kv_caches = {}
        for name, layer in self._vllm_config.compilation_config.static_forward_context.items():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, list | tuple):
                kv = kv[0] if kv and isinstance(kv[0], torch.Tensor) else None
            if isinstance(kv, torch.Tensor) and kv.numel() > 0:
                kv_caches[name] = kv
        if kv_caches:
            self.register_kv_caches(kv_caches)

    def _open_tier(self, tier: TierConfig, block_bytes: int) -> Backend:
        cls = backend_class(tier.backend)
        if cls.capabilities.shared:
            return cls.from_tier(tier)
        # The scheduler mirrors this tier and sizes it in blocks from an estimate; give
        # the store room for exactly that many blocks of the measured size.
        estimate = estimated_block_bytes(self._vllm_config, self._kv_cache_config)
        if estimate != block_bytes:
            logger.warning("ucm: block size estimate %d != measured %d", estimate, block_bytes)
        capacity = max(tier.capacity // estimate, 0) * block_bytes
        return cls.from_tier(TierConfig(tier.backend, max(capacity, 1), tier.options))

    def _shard_key(self, key: BlockKey) -> BlockKey:
        return shard_key(key, self._shard, self._num_shards)

    def _read(
        self, tier: int, indices: list[int], buffers: list[memoryview], ok: list[bool]
    ) -> None:
        loads = self._meta.loads
        keys = [self._shard_key(loads[i].key) for i in indices]
        results = self._tiers[tier].load(keys, [buffers[i] for i in indices]).wait()
        for index, done in zip(indices, results, strict=True):
            ok[index] = ok[index] or done

    def _write(
        self, tier: int, indices: list[int], keys: list[BlockKey], buffers: list[memoryview]
    ) -> None:
        shard_keys = [self._shard_key(key) for key in keys]
        results = self._tiers[tier].dump(shard_keys, [buffers[i] for i in indices]).wait()
        if not all(results):
            logger.warning(
                "ucm: %d of %d blocks not written to tier %d",
                results.count(False),
                len(results),
                tier,
            )
