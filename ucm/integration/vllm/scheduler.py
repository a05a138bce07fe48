"""The scheduler half of the connector: lookup, placement and per-step metadata.

It never touches tensors. For each request it computes block keys, finds the longest
stored prefix across the tiers, tells vLLM how many tokens can be loaded, and each
step tells the worker half which blocks to load, which to save and where, and which
blocks to evict from the tiers it manages.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from ucm.config import UCMConfig
from ucm.eviction import make_policy
from ucm.integration.vllm.events import KVEvents
from ucm.integration.vllm.metadata import BlockLoad, BlockSave, UCMConnectorMetadata
from ucm.integration.vllm.model_info import estimated_block_bytes, key_space, num_shards
from ucm.integration.vllm.residency import MirroredTier, SharedTier, TierView, stored_prefix
from ucm.integration.vllm.stats import StatsRecorder, tier_name
from ucm.keys import KeyChain, request_root
from ucm.store.base import BlockKey
from ucm.store.registry import backend_class

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # Under vLLM's configured logger tree.

FAILED_BLOCK_SECONDS = 60.0
"""How long a block whose load failed is not offered again (unless this engine saves
it again first), so that a bad copy cannot make a request recompute in a loop."""


@dataclass
class _RequestState:
    request: Request
    chain: KeyChain
    block_ids: list[int] = field(default_factory=list)
    hit_tiers: list[int] = field(default_factory=list)
    """Tier of each leading stored block, as found by the last lookup."""
    lookup_computed_tokens: int = 0
    """Tokens vLLM had computed locally at the last lookup."""
    num_saved_blocks: int = 0
    """Leading blocks that are stored or need no saving."""
    pending_load: range | None = None
    """Block indices to load in the next step."""
    load_async: bool = False
    """Whether the planned load runs in the background (vLLM waits for ``get_finished``)."""


def _computes_on_cached_prefixes(vllm_config: VllmConfig) -> bool:
    """Return whether the engine computes prompts on top of KV already in its cache.

    vLLM does so for its own prefix cache and for chunked prefill. Where both are off
    (vLLM forces that where the attention backend cannot, e.g. MLA on CPU), a prompt
    computed on top of loaded KV takes a path vLLM never takes, and need not be exact.
    """
    return bool(
        vllm_config.cache_config.enable_prefix_caching
        or vllm_config.scheduler_config.enable_chunked_prefill
    )


class UCMScheduler:
    """Scheduler-side state and decisions of :class:`UCMConnector`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: UCMConfig,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        """Build the tier views and the key space.

        Args:
            vllm_config: The engine's configuration.
            config: ucm's parsed configuration.
            kv_cache_config: vLLM's KV cache layout, when the connector was given it.
        """
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self._block_size = int(vllm_config.cache_config.block_size)
        self._load_enabled = transfer.is_kv_consumer
        self._save_enabled = transfer.is_kv_producer
        if not _computes_on_cached_prefixes(vllm_config):
            logger.warning(
                "ucm: vLLM turned prefix caching and chunked prefill off for this model on "
                "this platform (as it does for MLA on CPU): the engine never computes a "
                "prompt on top of cached KV, and outputs computed that way are not exact. "
                "ucm neither loads nor saves blocks here."
            )
            self._load_enabled = self._save_enabled = False
        self._root = key_space(vllm_config, config).root()
        block_bytes = estimated_block_bytes(vllm_config, kv_cache_config)
        self._tiers: list[TierView] = []
        for index, tier in enumerate(config.tiers):
            cls = backend_class(tier.backend)
            if cls.capabilities.lossy and transfer.kv_load_failure_policy != "recompute":
                logger.warning(
                    "ucm: tiers[%d] (%s) may lose a block between lookup and load (a cache "
                    "server evicting, a restart); with kv_load_failure_policy=%r the request "
                    "that hit it fails. Set kv_load_failure_policy='recompute'.",
                    index,
                    tier.backend,
                    transfer.kv_load_failure_policy,
                )
            if cls.capabilities.shared:
                self._tiers.append(SharedTier(cls.from_tier(tier), num_shards(vllm_config)))
            else:
                policy = make_policy(tier.eviction)
                self._tiers.append(MirroredTier(tier.capacity // block_bytes, policy))
        self._async_load = config.async_load
        self._async_save = config.async_save
        self._persistent = [
            backend_class(tier.backend).capabilities.persistent for tier in config.tiers
        ]
        self._tier_names = [tier_name(i, tier) for i, tier in enumerate(config.tiers)]
        self._media = [backend_class(tier.backend).capabilities.medium for tier in config.tiers]
        self.stats = StatsRecorder()
        """Lookups and hits since vLLM last took them (``get_kv_connector_stats``)."""
        events = vllm_config.kv_events_config
        self._events = (
            KVEvents(self._block_size, self._media)
            if events is not None and events.enable_kv_cache_events
            else None
        )
        self._requests: dict[str, _RequestState] = {}
        # Requests finished since the last connector output: vLLM fails a request for
        # a bad load (policy "fail") before it reports the bad blocks.
        self._just_finished: list[_RequestState] = []
        # Requests whose saves may be written from their pages in the background
        # (async_save), and those whose loads run in the background (async_load).
        self._sending: set[str] = set()
        self._receiving: set[str] = set()
        self._to_release: list[str] = []  # Finished, held for their saves; tell the worker.
        self._steps = itertools.count(1)
        self._failed: OrderedDict[BlockKey, float] = OrderedDict()  # Key -> offer again after.
        self._failure_epoch = 0  # Steps whose failed loads were reported so far.

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Return how many tokens beyond ``num_computed_tokens`` ucm can load.

        Only whole blocks are offered, and never the last prompt token (vLLM must
        compute at least one token to produce logits).
        """
        state = self._state(request)
        if state is None or not self._load_enabled:
            return 0, False
        max_blocks = (request.num_tokens - 1) // self._block_size
        keys = state.chain.extend(request.all_token_ids, max_blocks)[:max_blocks]
        hit_tiers = stored_prefix(keys[: self._offered_prefix(keys)], self._tiers)
        state.hit_tiers = hit_tiers
        state.lookup_computed_tokens = num_computed_tokens
        state.num_saved_blocks = max(state.num_saved_blocks, len(hit_tiers))
        new_tokens = max(len(hit_tiers) * self._block_size - num_computed_tokens, 0)
        first = num_computed_tokens // self._block_size
        state.load_async = (
            self._async_load
            and new_tokens > 0
            and any(self._tiers[tier].io_bound for tier in hit_tiers[first:])
        )
        return new_tokens, state.load_async

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Stop offering blocks whose load failed, and save them again once recomputed.

        Args:
            output: What the workers reported this step; only its failed blocks matter.
        """
        self._receiving.difference_update(output.finished_recving or ())
        invalid = output.invalid_block_ids
        just_finished, self._just_finished = self._just_finished, []
        if not invalid:
            return
        self._failure_epoch += 1
        until = time.monotonic() + FAILED_BLOCK_SECONDS
        for state in [*self._requests.values(), *just_finished]:
            keys = state.chain.keys
            failed = [i for i, b in enumerate(state.block_ids[: len(keys)]) if b in invalid]
            if not failed:
                continue
            for index in failed:  # Shared views may list them until their next refresh.
                self._failed[keys[index]] = until
                self._failed.move_to_end(keys[index])
            # The worker also dropped the saves of blocks computed on a failed one.
            for key in keys[failed[0] : max(state.num_saved_blocks, failed[-1] + 1)]:
                for view in self._tiers:
                    view.discard(key)
            state.num_saved_blocks = min(state.num_saved_blocks, failed[0])

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the blocks vLLM allocated for the external tokens."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self._record_lookup(state, num_external_tokens)
        if num_external_tokens <= 0:
            return
        state.block_ids = list(blocks.get_block_ids()[0])
        loaded = self._loaded_blocks(state, num_external_tokens)
        if loaded.stop > len(state.hit_tiers) or loaded.stop > len(state.block_ids):
            logger.warning("ucm: dropping inconsistent load plan for %s", request.request_id)
            return
        state.pending_load = loaded

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UCMConnectorMetadata:
        """Turn this step's decisions into the worker half's instructions."""
        step = next(self._steps)
        self._just_finished = []  # The connector output of their last step was handled.
        meta = UCMConnectorMetadata(failure_epoch=self._failure_epoch)
        loading = [
            (state, state.pending_load)
            for state in self._requests.values()
            if state.pending_load is not None
        ]
        for state, indices in loading:  # Pin every block read this step before any eviction.
            for index in indices:
                self._tiers[state.hit_tiers[index]].touch(state.chain.keys[index], step)
        used: list[list[BlockKey]] = []  # Chains that loaded or saved blocks this step.
        for state, indices in loading:
            loads = self._plan_load(state, indices, step)
            if state.load_async:
                meta.async_loads[state.request.request_id] = loads
                self._receiving.add(state.request.request_id)
            else:
                meta.loads.extend(loads)
            used.append(state.chain.keys[: indices.stop])
            state.pending_load = None
        if self._save_enabled:
            meta.saves.extend(self._plan_saves(scheduler_output, step, used, meta.tables))
        if self._async_save:
            self._hold_for_saves(meta, scheduler_output)
        # A chain is useless past its first missing block, so eviction must eat tails
        # first: touch each chain used this step from tail to head (head most recent).
        for keys in used:
            for key in reversed(keys):
                for view in self._tiers:
                    view.touch(key, step)
        for index, view in enumerate(self._tiers):
            evicted = view.take_evictions()
            if evicted:
                meta.evictions[index] = evicted
                if self._events is not None:
                    self._events.removed(index, evicted)
        return meta

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """Split a request's loaded tokens by the medium of the tier each block comes from.

        Args:
            request: A request just given ``num_external_tokens`` by ucm.
            num_external_tokens: The tokens ucm loads for it.

        Returns:
            Tokens per medium (``memory``, ``disk``, ``remote``), only non-zero counts.
        """
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return {}
        loaded = self._loaded_blocks(state, num_external_tokens)
        tiers = state.hit_tiers[loaded.start : loaded.stop]
        if not tiers:
            return {}
        sources: dict[str, int] = {}
        for tier in tiers:
            medium = self._media[tier]
            sources[medium] = sources.get(medium, 0) + self._block_size
        if sum(sources.values()) != num_external_tokens:  # A partial block: trim the last.
            medium = self._media[tiers[-1]]
            sources[medium] -= sum(sources.values()) - num_external_tokens
        return {medium: tokens for medium, tokens in sources.items() if tokens > 0}

    def take_events(self) -> list[KVCacheEvent]:
        """Return the KV events since the last call (none unless vLLM's events are on)."""
        return self._events.take() if self._events is not None else []

    def request_finished(self, request: Request) -> bool:
        """Forget a finished request; return whether vLLM must keep its blocks until the
        worker reports the request sent, because saves may still be written from its
        pages (``async_save``).

        A request whose loads still run in the background is not held: vLLM itself
        keeps its blocks until the worker reports it loaded, and it has written
        nothing since its last preemption waited for its writes.
        """
        request_id = request.request_id
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._just_finished.append(state)
        held = request_id in self._sending and request_id not in self._receiving
        self._sending.discard(request_id)
        if held:
            self._to_release.append(request_id)
        return held

    def close(self) -> None:
        """Stop the tier views' background work."""
        for view in self._tiers:
            view.close()

    def tracked_requests(self) -> frozenset[str]:
        """Return the ids of requests this half holds state for (live or held)."""
        return frozenset(self._requests).union(self._sending, self._receiving)

    def _hold_for_saves(self, meta: UCMConnectorMetadata, output: SchedulerOutput) -> None:
        """Mark the requests whose saves go to persistent tiers as sending (``async_save``)."""
        sending = {
            save.request_id
            for save in meta.saves
            if any(self._persistent[tier] for tier in save.tiers)
        }
        self._sending.update(sending)
        meta.sending = sorted(sending)
        meta.preempted = sorted(self._sending.intersection(output.preempted_req_ids or ()))
        meta.release, self._to_release = self._to_release, []

    def _record_lookup(self, state: _RequestState, num_external_tokens: int) -> None:
        """Count a request's lookup once it is scheduled (vLLM may ask several times)."""
        stats = self.stats
        stats.count("lookups")
        possible = (state.request.num_tokens - 1) // self._block_size * self._block_size
        stats.count("query_tokens", max(possible - state.lookup_computed_tokens, 0))
        stats.count("hit_tokens", num_external_tokens)
        loaded = self._loaded_blocks(state, num_external_tokens)
        for tier in state.hit_tiers[loaded.start : loaded.stop]:
            stats.count(f"hit_tokens|{self._tier_names[tier]}", self._block_size)

    def _loaded_blocks(self, state: _RequestState, num_external_tokens: int) -> range:
        """Return the indices of the blocks ucm loads for ``num_external_tokens`` tokens."""
        first = state.lookup_computed_tokens // self._block_size
        return range(first, first - (-num_external_tokens // self._block_size))

    def _state(self, request: Request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is None:
            if request.mm_features or request.prompt_embeds is not None:
                return None  # Multimodal and embedding inputs are not keyed by tokens alone.
            extra = []
            if request.lora_request is not None:
                extra.append(f"lora:{request.lora_request.lora_name}")
            if request.cache_salt:
                extra.append(f"salt:{request.cache_salt}")
            chain = KeyChain(request_root(self._root, extra), self._block_size)
            state = self._requests[request.request_id] = _RequestState(request, chain)
        return state

    def _offered_prefix(self, keys: list[BlockKey]) -> int:
        """Return how many leading keys may be offered (none whose load failed lately)."""
        failed = self._failed
        now = time.monotonic()
        while failed and next(iter(failed.values())) < now:
            failed.popitem(last=False)
        if not failed:
            return len(keys)
        return next((index for index, key in enumerate(keys) if key in failed), len(keys))

    def _plan_load(self, state: _RequestState, indices: range, step: int) -> list[BlockLoad]:
        loads = []
        for index in indices:
            key = state.chain.keys[index]
            source = state.hit_tiers[index]
            promote = tuple(t for t in range(source) if self._tiers[t].admit(key, step))
            loads.append(BlockLoad(state.block_ids[index], key, source, promote))
        return loads

    def _plan_saves(
        self,
        output: SchedulerOutput,
        step: int,
        used: list[list[BlockKey]],
        tables: dict[str, list[int]],
    ) -> list[BlockSave]:
        progress: list[tuple[str, int]] = []
        for new in output.scheduled_new_reqs:
            if (state := self._requests.get(new.req_id)) is not None:
                state.block_ids = list(new.block_ids[0])
                progress.append((new.req_id, new.num_computed_tokens))
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            if (state := self._requests.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            progress.append((req_id, cached.num_computed_tokens[index]))
        saves: list[BlockSave] = []
        planned: set[BlockKey] = set()
        for req_id, computed in progress:
            state = self._requests[req_id]
            drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            done = computed + output.num_scheduled_tokens.get(req_id, 0) - drafts
            tokens = state.request.all_token_ids
            full = min(done, len(tokens), len(state.block_ids) * self._block_size)
            num_full = full // self._block_size
            if num_full <= state.num_saved_blocks:
                continue  # No block became full this step (most decode steps).
            keys = state.chain.extend(tokens, num_full)[:num_full]
            first_save = len(saves)
            for index in range(state.num_saved_blocks, num_full):
                key = keys[index]
                if key in planned:
                    continue  # Requests sharing a prefix computed the same block this step.
                planned.add(key)
                self._failed.pop(key, None)  # Recomputed: it may be offered again once saved.
                tiers = tuple(t for t, view in enumerate(self._tiers) if view.admit(key, step))
                if tiers:
                    saves.append(BlockSave(state.block_ids[index], key, tiers, req_id))
                    if self._events is not None:
                        self._events.stored(state.request, index, key, tiers)
            if len(saves) > first_save:
                tables[req_id] = state.block_ids[:num_full]
            if len(keys) > state.num_saved_blocks:
                used.append(keys)
            state.num_saved_blocks = max(state.num_saved_blocks, len(keys))
        return saves
