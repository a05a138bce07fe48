"""The worker half of the connector: moves blocks between vLLM's paged KV and the tiers.

It carries out the scheduler half's instructions and decides nothing about placement
or eviction. Per step:

- delete the blocks the scheduler evicted;
- start reading the step's blocks on the reader threads (``start_load_kv``), straight
  into the KV pages where they are contiguous host memory, else into staging memory
  whose copies into the pages run on the copy stream (:mod:`ucm.transfer.streams`);
- finish them layer by layer as the forward pass reaches each layer
  (``wait_for_layer_load``), once vLLM has shown that it calls that hook for every
  layer; until then, and under wrappers that never call it, loads finish before the
  forward pass starts;
- copy saved blocks out as the forward pass writes them, and write them to their
  tiers in the background, except in-memory tiers written straight from the pages,
  which happens at once (with ``async_save``, persistent tiers are written straight
  from the pages, which vLLM keeps until ``get_finished`` reports the request sent);
- read the blocks of requests that wait for their KV (``async_load``) in the
  background, and report each request through ``get_finished`` once its blocks are
  in place.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from ucm.config import TierConfig, UCMConfig
from ucm.integration.vllm.metadata import BlockLoad, BlockSave, UCMConnectorMetadata
from ucm.integration.vllm.metered import MeteredBackend
from ucm.integration.vllm.model_info import estimated_block_bytes, num_shards, rank_shard
from ucm.integration.vllm.stats import StatsRecorder, tier_name
from ucm.keys import shard_key
from ucm.store.base import Backend, BlockKey, Segments
from ucm.store.registry import backend_class
from ucm.transfer.paged import PagedKV, StagingPool, find_block_dim
from ucm.transfer.reader import BlockRead, BlockReader, PendingReads
from ucm.transfer.streams import COMPLETE, CopyEvent, CopyStream, HostStream, copy_stream
from ucm.transfer.writer import BackgroundWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(f"vllm.{__name__}")  # Under vLLM's configured logger tree.


def _rank_shard(vllm_config: VllmConfig) -> tuple[int, bool]:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    return rank_shard(vllm_config, int(tp_rank), int(pp_rank))


def _after_all(copied: dict[str, CopyEvent]) -> CopyEvent:
    """Return an event after every copy of ``copied`` (its last: a stream runs in order)."""
    return next(reversed(copied.values()), COMPLETE)


@dataclass
class _Reads:
    """Loads whose reads run on the reader threads."""

    loads: list[BlockLoad]
    """The scheduler's instructions."""
    payloads: Sequence[Segments]
    """Where each block is read to: its KV pages, or a staging row."""
    pending: PendingReads
    """The reads in flight."""
    rows: torch.Tensor | None
    """Staging rows to scatter into the pages (None: read in place)."""


@dataclass
class _StepLoad:
    """A step's loads in flight, which its forward pass needs."""

    reads: _Reads
    """The loads and their reads."""
    layerwise: bool
    """Whether the forward pass started before the loads finished."""
    pending_layers: set[str]
    """Layers whose pages the forward pass may not read yet."""
    ok: list[bool] | None = None
    """Per load, whether it succeeded (once the reads finished)."""
    copied: dict[str, CopyEvent] = dataclasses.field(default_factory=dict)
    """Per layer, an event after the copies of its staged pages into place (once the
    reads finished; staging only)."""


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
        parallel = vllm_config.parallel_config
        ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        # Which shard of each block this rank holds, and whether it writes it to shared
        # tiers (with MLA one rank per stage writes what all of them hold).
        self._shard, self._writes_shared = _rank_shard(vllm_config) if ranks > 1 else (0, True)
        self._paged: PagedKV | None = None
        self._in_place = False  # Whether stores read and write the KV pages themselves.
        self._tiers: list[Backend] = []
        self._staging: StagingPool | None = None
        self._stream: CopyStream = HostStream()  # Where staged pages are copied.
        self._reader = BlockReader(config.io_threads)
        self._writer = BackgroundWriter(config.max_pending_write_bytes, config.io_threads)
        self._meta = UCMConnectorMetadata()
        self._step_load: _StepLoad | None = None
        self._layerwise = False  # Set once vLLM called wait_for_layer_load for every layer.
        self._waited: set[str] = set()  # Layers vLLM waited for in this step.
        self._save_rows: torch.Tensor | None = None  # This step's, until its writes finish.
        self._save_block_ids: list[int] = []  # The blocks staged in ``_save_rows``.
        self._stage_saves = False
        self._gathered: set[str] = set()
        self._load_errors: set[int] = set()
        # Blocks whose load failed, with the failure epoch of the step that found them.
        self._failures: list[tuple[int, set[int]]] = []
        self._background: dict[str, _Reads] = {}  # Requests waiting for their loads.
        self._finished_loads: set[str] = set()  # Requests to report through get_finished.
        self._background_seen = False  # Whether a background load was started (logged once).
        # Background writes from the pages of each request (async_save), and the
        # finished requests to report once theirs are done.
        self._sends: Counter[str] = Counter()
        self._sends_done = threading.Condition()
        self._releasing: set[str] = set()
        self.stats = StatsRecorder()
        """Transfers and errors since vLLM last took them (``get_kv_connector_stats``)."""
        transfer = vllm_config.kv_transfer_config
        # A prefill instance's response must not come before its KV is in the store.
        self._publish_each_step = transfer is not None and transfer.kv_role == "kv_producer"

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the KV tensors vLLM allocated and open the tiers."""
        context = self._vllm_config.compilation_config.static_forward_context
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        layers = []
        for name, tensor in kv_caches.items():
            backend = getattr(context.get(name), "attn_backend", None)
            layers.append((name, tensor, find_block_dim(tensor, backend, num_blocks)))
        self._paged = paged = PagedKV(layers)
        self._in_place = paged.in_place and self._config.in_place
        self._staging = StagingPool(paged.block_bytes, pin=paged.device.type != "cpu")
        self._stream = copy_stream(paged.device)
        self._tiers = [
            MeteredBackend(self._open_tier(tier, paged.block_bytes), tier_name(i, tier), self.stats)
            for i, tier in enumerate(self._config.tiers)
        ]
        logger.info(
            "ucm: %d KV layers, %d bytes per block, pages %s, tiers %s",
            len(paged.layers),
            paged.block_bytes,
            "read and written in place" if self._in_place else "copied through staging",
            [tier.backend for tier in self._config.tiers],
        )

    def bind(self, meta: UCMConnectorMetadata) -> None:
        """Accept this step's instructions."""
        self._ensure_registered()
        self._meta = meta
        self._waited = set()
        self._gathered = set()
        self._releasing.update(meta.release)
        self.wait_for_sends(meta.preempted)  # Normally done already (handle_preemptions).
        persistent = {t for t, tier in enumerate(self._tiers) if tier.capabilities.persistent}
        from_pages = set(meta.sending) if self._in_place else set()
        self._stage_saves = any(
            not self._in_place
            or (persistent.intersection(save.tiers) and save.request_id not in from_pages)
            for save in meta.saves
        )

    def clear(self) -> None:
        """Drop this step's instructions (and its staging rows, if nobody writes them)."""
        self._finish_load()
        self._meta = UCMConnectorMetadata()
        if self._save_rows is not None and self._staging is not None:
            self._staging.release(self._save_rows, self._stream.record())
        self._save_rows = None

    def start_load_kv(self) -> None:
        """Delete evicted blocks, then start reading this step's blocks.

        Until vLLM has shown that it calls :meth:`wait_for_layer_load` for every layer,
        the loads also finish here, before the forward pass.
        """
        self._finish_load()
        self._apply_evictions()
        if self._paged is None:
            return
        background = self._meta.async_loads
        if background and not self._background_seen:
            self._background_seen = True
            logger.info("ucm: loading blocks in the background; vLLM schedules other requests")
        while background:  # One at a time: if a start fails, the rest stay to be failed.
            request_id, loads = next(iter(background.items()))
            self._background[request_id] = self._start_reads(loads)
            del background[request_id]
        if not self._meta.loads:
            return
        self._step_load = _StepLoad(
            reads=self._start_reads(self._meta.loads),
            layerwise=self._layerwise,
            pending_layers={layer.name for layer in self._paged.layers},
        )
        if not self._layerwise:
            for layer in self._paged.layers:
                self._make_ready(self._step_load, layer.name)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's loads of ``layer_name`` are in the paged buffer."""
        self._waited.add(layer_name)
        if self._step_load is not None:
            self._make_ready(self._step_load, layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        """Copy this layer's pages of the blocks being saved, now that it wrote them.

        Only needed where the saves go through staging rows: where the pages are not
        contiguous host memory, and for persistent tiers written after the paged
        blocks may have been reused (all of them unless ``async_save``).
        """
        saves = self._meta.saves
        if not self._stage_saves or self._paged is None or self._staging is None:
            return
        layer = self._paged.layer(layer_name)
        if layer is None or layer_name in self._gathered:
            return
        if self._save_rows is None:
            self._save_rows = self._staging.acquire(len(saves))
            self._save_block_ids = [save.block_id for save in saves]
        rows, ids, paged = self._save_rows, self._save_block_ids, self._paged
        self._stream.follow_compute()  # The forward pass has just written these pages.
        self._stream.run(partial(paged.gather, layer, ids, rows, len(ids)))
        self._gathered.add(layer_name)

    def wait_for_save(self) -> None:
        """Finish the step's loads, then write its saved blocks to their tiers.

        Where the blocks go through staging memory, every tier is written in the
        background, once the copy stream has filled the rows, which stay reserved until
        their writes finish. Otherwise in-memory tiers are written now, from the pages
        themselves, and persistent tiers (disk, remote) in the background, from the
        pages with ``async_save`` (vLLM keeps them for as long). A ``kv_producer`` (a
        prefill instance) waits for its writes too, so that its response never reaches
        a decode instance before the KV is in the store.
        """
        self._finish_load()
        tainted = self._tainted_requests()
        saves = self._meta.saves
        if not saves or self._paged is None or self._staging is None:
            return
        for layer in self._paged.layers:
            self.save_kv_layer(layer.name)
        self._apply_evictions()  # Before any write, whichever hook vLLM calls first.
        rows, self._save_rows = self._save_rows, None
        gathered, staged = COMPLETE, None
        if rows is not None:
            # vLLM may hand these pages to other requests from the next step on.
            gathered = self._stream.record()
            self._stream.make_compute_wait(gathered)
            staged = self._paged.staged_payloads(rows, len(saves))
        by_tier: dict[int, list[int]] = defaultdict(list)
        for index, save in enumerate(saves):
            if save.request_id in tainted:
                continue  # Computed on top of a block that failed to load: garbage.
            for tier in save.tiers:
                if self._writes_shared or not self._tiers[tier].capabilities.shared:
                    by_tier[tier].append(index)
        # From the pages, in-memory tiers are written now (vLLM may reuse the pages after
        # this step); from staging memory every tier is written in the background, so that
        # the step never waits for the copy stream.
        background = [
            t for t in by_tier if rows is not None or self._tiers[t].capabilities.persistent
        ]
        in_memory = [t for t in by_tier if t not in background]
        sending = set(self._meta.sending)
        self._meta = UCMConnectorMetadata()
        if not by_tier:
            if rows is not None:
                self._staging.release(rows, gathered)
            return
        payloads = staged or self._paged.block_pages([save.block_id for save in saves])
        for tier in in_memory:
            indices = by_tier[tier]
            self._write(tier, [saves[i].key for i in indices], [payloads[i] for i in indices])
        if not background:
            return
        assert rows is not None or all(
            saves[i].request_id in sending for t in background for i in by_tier[t]
        ), "persistent saves from the pages of a request vLLM does not keep"
        background_tiers = {tier: by_tier[tier] for tier in background}
        self._write_behind(saves, payloads, background_tiers, rows, gathered)
        if self._publish_each_step:
            self._writer.flush()

    def _tainted_requests(self) -> set[str]:
        """Return the requests whose saves this step must drop.

        A request computed in a step where one of the blocks it attends to failed to
        load produced garbage from that block on. vLLM recomputes it, but steps the
        scheduler planned before it was told of the failure (the next one, under
        asynchronous scheduling) still compute on the garbage: their saves of the
        request are dropped too, until the scheduler's failure epoch moves on.
        """
        epoch = self._meta.failure_epoch
        self._failures = [(e, ids) for e, ids in self._failures if e >= epoch]
        if self._load_errors:  # This step's, not yet reported to vLLM.
            self._failures.append((epoch, set(self._load_errors)))
        if not self._failures:
            return set()
        failed = set().union(*(ids for _, ids in self._failures))
        return {r for r, table in self._meta.tables.items() if not failed.isdisjoint(table)}

    def fail_pending_loads(self) -> None:
        """Report every load of this step as failed (after an unexpected error)."""
        self._load_errors.update(load.block_id for load in self._meta.loads)
        for request_id, loads in self._meta.async_loads.items():  # Those not started.
            self._load_errors.update(load.block_id for load in loads)
            self._finished_loads.add(request_id)
        self._meta.async_loads = {}

    def take_finished_loads(self) -> set[str]:
        """Complete the background loads whose reads finished; return their requests.

        A load that failed is reported through :meth:`take_load_errors`, which vLLM
        asks right after this; its request is reported as finished all the same.
        """
        for request_id, reads in list(self._background.items()):
            if not reads.pending.done():
                continue
            del self._background[request_id]
            self._finished_loads.add(request_id)
            copied = COMPLETE
            try:
                ok = reads.pending.wait()
                if reads.rows is not None:
                    copied = _after_all(self._copy_loaded(reads, ok))
                    self._stream.make_compute_wait(copied)
                self._settle(reads, ok)
            except Exception:  # noqa: BLE001 - fault barrier: a bad load must mean recompute
                logger.exception("ucm: finishing the loads of %s failed", request_id)
                self._load_errors.update(load.block_id for load in reads.loads)
            finally:
                self._release(reads, copied)
        finished, self._finished_loads = self._finished_loads, set()
        return finished

    def take_load_errors(self) -> set[int]:
        """Return and forget the block ids whose load failed."""
        errors, self._load_errors = self._load_errors, set()
        self.stats.count("errors|load_failed", len(errors))
        return errors

    def take_finished_sends(self) -> set[str]:
        """Return the finished requests whose writes from their pages are all done.

        vLLM keeps their blocks until they are reported here (``async_save``).
        """
        with self._sends_done:
            done = {r for r in self._releasing if not self._sends[r]}
            self._releasing -= done
        return done

    def wait_for_sends(self, request_ids: Sequence[str]) -> None:
        """Block until no write from the pages of ``request_ids`` is pending (their
        blocks are about to be reused: vLLM preempted them)."""
        with self._sends_done:
            self._sends_done.wait_for(lambda: not any(self._sends[r] for r in request_ids))

    def flush(self) -> None:
        """Block until every background write has finished."""
        self._writer.flush()

    def close(self) -> None:
        """Finish transfers, then close every tier."""
        self._finish_load()
        for reads in self._background.values():
            reads.pending.wait()
        self._background.clear()
        self._reader.close()
        self._writer.close()
        for tier in self._tiers:
            tier.close()
        self._tiers = []

    def _make_ready(self, step: _StepLoad, layer_name: str) -> None:
        """Finish the step's reads (once), then put the layer's loaded pages in place."""
        if layer_name not in step.pending_layers:
            return
        if step.ok is None:
            step.ok = step.reads.pending.wait()
            if step.reads.rows is not None:
                step.copied = self._copy_loaded(step.reads, step.ok)
        if step.reads.rows is None:  # Read in place: every layer is ready.
            step.pending_layers.clear()
            return
        step.pending_layers.discard(layer_name)
        if layer_name in step.copied:
            self._stream.make_compute_wait(step.copied[layer_name])

    def _finish_load(self) -> None:
        """Complete the step's loads after the forward pass: report errors, promote.

        Loads that the forward pass may have read before they were in place (vLLM did
        not wait for their layer) are reported as errors, so that vLLM recomputes
        them, and loads stop overlapping the forward pass.
        """
        step, self._step_load = self._step_load, None
        if step is None:
            return
        try:
            self._complete_load(step)
        except Exception:
            self._load_errors.update(load.block_id for load in step.reads.loads)  # Recompute.
            raise
        finally:
            self._release(step.reads, _after_all(step.copied))

    def _complete_load(self, step: _StepLoad) -> None:
        """Put any pages not yet in place, report failed loads, promote loaded blocks."""
        missed = set(step.pending_layers)
        for name in missed:
            self._make_ready(step, name)
        assert step.ok is not None
        if step.layerwise and missed:
            logger.warning(
                "ucm: vLLM did not wait for the loads of %d layers; they are recomputed and "
                "loads finish before the forward pass from now on",
                len(missed),
            )
            self._layerwise = False
            step.ok = [False] * len(step.reads.loads)
        elif not step.layerwise and self._paged is not None:
            self._layerwise = all(layer.name in self._waited for layer in self._paged.layers)
            if self._layerwise:
                logger.info("ucm: vLLM waits for every layer; loads now overlap the forward pass")
        self._settle(step.reads, step.ok)

    def _start_reads(self, loads: list[BlockLoad]) -> _Reads:
        """Start reading blocks into their pages (or staging rows) on the reader threads."""
        assert self._paged is not None and self._staging is not None
        self._writer.wait_for([self._shard_key(load.key) for load in loads])
        rows = None
        if self._in_place:
            payloads = self._paged.block_pages([load.block_id for load in loads])
        else:
            rows = self._staging.acquire(len(loads))
            payloads = self._paged.staged_payloads(rows, len(loads))
        reads = [
            BlockRead(self._shard_key(load.key), load.tier, payload)
            for load, payload in zip(loads, payloads, strict=True)
        ]
        return _Reads(loads, payloads, self._reader.start(self._tiers, reads), rows)

    def _copy_loaded(self, reads: _Reads, ok: list[bool]) -> dict[str, CopyEvent]:
        """Issue the copies of the staged loads that succeeded into their pages, every
        layer in order, on the copy stream; return an event per layer after its copies.

        The copies follow everything the forward pass was given so far: the pages may
        have belonged to requests whose last work is still queued.
        """
        paged, rows = self._paged, reads.rows
        assert paged is not None and rows is not None
        loaded = [i for i, done in enumerate(ok) if done]
        if not loaded:
            return {}
        ids = [reads.loads[i].block_id for i in loaded]
        count = len(reads.loads)
        positions = None if len(loaded) == count else loaded
        self._stream.follow_compute()
        copied = {}
        for layer in paged.layers:
            self._stream.run(partial(paged.scatter, layer, ids, rows, count, positions))
            copied[layer.name] = self._stream.record()
        return copied

    def _settle(self, reads: _Reads, ok: list[bool]) -> None:
        """Report the loads that failed; copy the others into the tiers they go up to."""
        self._load_errors.update(
            load.block_id for load, done in zip(reads.loads, ok, strict=True) if not done
        )
        promotions: dict[int, list[int]] = defaultdict(list)
        for index, load in enumerate(reads.loads):
            if ok[index]:
                for tier in load.promote_to:
                    promotions[tier].append(index)
        for tier, indices in promotions.items():
            keys = [reads.loads[i].key for i in indices]
            self._write(tier, keys, [reads.payloads[i] for i in indices])

    def _release(self, reads: _Reads, after: CopyEvent) -> None:
        """Give the reads' staging rows back once the copies out of them (``after``) ran."""
        if reads.rows is not None and self._staging is not None:
            self._staging.release(reads.rows, after)

    def _write_behind(
        self,
        saves: list[BlockSave],
        payloads: Sequence[Segments],
        by_tier: dict[int, list[int]],
        rows: torch.Tensor | None,
        gathered: CopyEvent,
    ) -> None:
        """Write saves to their tiers in the background.

        Args:
            saves: The step's saves.
            payloads: Per save, its staging row or its KV pages.
            by_tier: Per persistent tier, the indices of the saves it gets.
            rows: The staging rows holding the payloads, freed once every write is
                done; None when the payloads are KV pages, which vLLM keeps until
                :meth:`take_finished_sends` reports their requests.
            gathered: Reached once the copies into ``rows`` ran; writes wait for it.
        """
        remaining = [len(by_tier)]
        lock = threading.Lock()
        pool = self._staging
        assert pool is not None

        def release_when_all_done() -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0 and rows is not None:
                    pool.release(rows)

        for tier, indices in by_tier.items():
            keys = [self._shard_key(saves[i].key) for i in indices]
            chosen = [payloads[i] for i in indices]
            owners = {saves[i].request_id for i in indices} if rows is None else set()
            with self._sends_done:
                self._sends.update(owners)

            def done(owners: set[str] = owners) -> None:
                release_when_all_done()
                with self._sends_done:
                    self._sends.subtract(owners)
                    for request_id in owners:
                        if not self._sends[request_id]:
                            del self._sends[request_id]
                    self._sends_done.notify_all()

            try:
                self._writer.submit(self._tiers[tier], keys, chosen, done, gathered.synchronize)
            except BaseException:
                done()
                raise

    def _apply_evictions(self) -> None:
        """Delete the blocks the scheduler evicted this step (once per step).

        The scheduler sized this step's writes to fit after these deletions, so they
        must come first for the tiers to hold exactly what its mirror says.
        """
        for tier, keys in self._meta.evictions.items():
            shard_keys = [self._shard_key(key) for key in keys]
            self._writer.wait_for(shard_keys)  # A pending write would land after the delete.
            self._tiers[tier].delete(shard_keys)
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
        return cls.from_tier(dataclasses.replace(tier, capacity=max(capacity, 1)))

    def _shard_key(self, key: BlockKey) -> BlockKey:
        return shard_key(key, self._shard, self._num_shards)

    def _write(self, tier: int, keys: list[BlockKey], payloads: Sequence[Segments]) -> None:
        """Write blocks to a tier now (in-memory tiers), logging the ones it refused."""
        shard_keys = [self._shard_key(key) for key in keys]
        results = self._tiers[tier].dump(shard_keys, payloads).wait()
        if not all(results):
            logger.warning(
                "ucm: %d of %d blocks not written to tier %d",
                results.count(False),
                len(results),
                tier,
            )
