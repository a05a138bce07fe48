"""A harness that drives vLLM's real ``Scheduler`` with ``UCMConnector`` and no engine.

The test plays the model runner: after every ``schedule()`` it feeds one sampled token
per request that has finished its prompt to ``update_from_output``, and checks each
step's metadata against the block tables vLLM really allocated.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ucm.config import parse_config
from ucm.integration.vllm import plugin
from ucm.integration.vllm.metadata import UCMConnectorMetadata
from ucm.integration.vllm.model_info import key_space
from ucm.keys import KeyChain
from ucm.store.base import BlockKey
from ucm.store.posix import PosixBackend
from ucm.testing.model import NUM_SPECIAL_TOKENS, TINY, make_prompt_token_ids

BLOCK = 32
"""Tokens per KV block (vLLM's CPU backend needs a multiple of 32)."""
PAYLOAD = memoryview(b"\x5a" * 64)
"""What the test stores per block: the scheduler half never reads payloads."""


def prompt(num_tokens: int, seed: int) -> list[int]:
    """Return reproducible non-special token ids for the tiny model."""
    return make_prompt_token_ids(num_tokens, seed=seed, vocab_size=TINY.vocab_size)


def posix_tiers(store: Path, index_refresh_seconds: float = 0.0) -> list[dict[str, Any]]:
    """Return ucm settings for one ``posix`` tier in ``store``.

    Tests store blocks behind the connector's back while it runs, so by default its
    lookups ask the store itself rather than an in-memory view refreshed every second.
    """
    return [
        {
            "backend": "posix",
            "path": str(store),
            "capacity": "1GiB",
            "index_refresh_seconds": index_refresh_seconds,
        }
    ]


@dataclass
class Step:
    """One ``schedule()`` call and what the scheduled requests looked like right after it."""

    output: SchedulerOutput
    meta: UCMConnectorMetadata
    tables: dict[str, list[int]]
    """Block table of every scheduled request."""
    computed: dict[str, int]
    """Tokens every scheduled request had computed (or loaded) before this step."""
    keys: dict[str, list[BlockKey]]
    """Keys of every scheduled request's full blocks (prompt and output so far)."""

    def loaded(self, req_id: str) -> list[int]:
        """Return the block indices of ``req_id`` this step loads, in metadata order."""
        slots = self._slots(req_id)
        return [
            slots[(load.key, load.block_id)]
            for load in self.meta.loads
            if (load.key, load.block_id) in slots
        ]

    def saved(self, req_id: str) -> list[int]:
        """Return the block indices of ``req_id`` this step saves, in metadata order."""
        slots = self._slots(req_id)
        return [
            slots[(save.key, save.block_id)]
            for save in self.meta.saves
            if (save.key, save.block_id) in slots
        ]

    def _slots(self, req_id: str) -> dict[tuple[BlockKey, int], int]:
        pairs = zip(self.keys[req_id], self.tables[req_id], strict=False)
        return {pair: index for index, pair in enumerate(pairs)}


@dataclass
class Harness:
    """vLLM's real scheduler with ``UCMConnector``; the test plays the model runner."""

    scheduler: Scheduler
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    num_blocks: int
    root: bytes
    """The connector's key-chain root (its key space)."""
    store: PosixBackend | None
    """The pre-populated ``posix`` store, when a tier is one."""
    store_tier: int | None
    """Index of that tier."""
    persist_saves: bool = False
    """Write every planned save into ``store`` after its step, as the worker would."""
    steps: list[Step] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)

    def chain(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Return the keys the connector computes for the full blocks of ``token_ids``."""
        return KeyChain(self.root, BLOCK).extend(list(token_ids))

    def put(self, keys: Sequence[BlockKey]) -> None:
        """Store a block under each key, as another engine would have."""
        assert self.store is not None
        assert all(self.store.dump(keys, [[PAYLOAD]] * len(keys)).wait())

    def add(self, req_id: str, token_ids: list[int], max_tokens: int) -> Request:
        """Add a greedy request that stops after ``max_tokens`` output tokens."""
        request = Request(
            request_id=req_id,
            prompt_token_ids=token_ids,
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        return request

    def schedule(self) -> Step:
        """Run ``schedule()``, record the step and check it against vLLM's block tables."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, UCMConnectorMetadata)
        step = Step(output, meta, {}, {}, {})
        manager = self.scheduler.kv_cache_manager
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            step.tables[req_id] = list(manager.get_block_ids(req_id)[0])
            step.computed[req_id] = request.num_computed_tokens - num_tokens
            step.keys[req_id] = self.chain(request.all_token_ids)
        check_step(step)
        self.steps.append(step)
        return step

    def update(self, step: Step, kv_output: KVConnectorOutput | None = None) -> None:
        """Play the model runner: one token per request that has consumed its whole prompt.

        Args:
            step: The step to answer.
            kv_output: What the workers' connectors report (finished loads, failed
                blocks). By default, the finished requests the step releases
                (``async_save``), as workers whose writes are all done would.
        """
        if kv_output is None and step.meta.release:
            kv_output = KVConnectorOutput(finished_sending=set(step.meta.release))
        req_ids = list(step.output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is not None and request.num_computed_tokens >= request.num_tokens:
                sampled.append([next_token(req_id, request.num_tokens)])
            else:
                sampled.append([])  # A prompt chunk, or a request aborted after scheduling.
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        self.scheduler.update_from_output(step.output, runner_output)
        if self.persist_saves and self.store is not None and step.meta.saves:
            self.put([save.key for save in step.meta.saves if self.store_tier in save.tiers])

    def step(self) -> Step:
        """Schedule one step and feed its model output back."""
        step = self.schedule()
        self.update(step)
        return step

    def run(self, max_steps: int = 1000) -> None:
        """Step until no request is left."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def free_blocks(self) -> int:
        """Return how many KV blocks the pool has free."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def assert_no_leaks(self) -> None:
        """Assert that no request, block or connector state outlives the requests."""
        scheduler = self.scheduler
        assert not scheduler.requests
        assert not scheduler.running
        assert len(scheduler.waiting) == 0
        assert len(scheduler.kv_holding_waiting) == 0
        # Block 0 is vLLM's null block: it is never free, so "all free" is one less.
        assert self.free_blocks() == self.num_blocks - 1
        pool = scheduler.kv_cache_manager.block_pool
        assert all(block.ref_cnt == 0 for block in pool.blocks)
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            assert not manager.req_to_blocks
        # The connector's per-request state (private, but a leak there grows for ever).
        assert not scheduler.connector.tracked_requests()  # type: ignore[union-attr]


def next_token(req_id: str, position: int) -> int:
    """Return the token the simulated model samples: deterministic, never special."""
    digest = zlib.crc32(f"{req_id}:{position}".encode())
    return NUM_SPECIAL_TOKENS + digest % (TINY.vocab_size - NUM_SPECIAL_TOKENS)


def check_step(step: Step) -> None:
    """Check invariants every step's metadata must satisfy, whatever the scenario.

    Every load and save names one scheduled request's block by its key and by the
    block id vLLM allocated for it now; loads only fill blocks counted as computed
    before the step, saves only blocks complete by the end of it; no key is saved
    twice, saved and loaded, or evicted while loaded or saved.
    """
    owners: dict[tuple[BlockKey, int], list[tuple[str, int]]] = {}
    for req_id, keys in step.keys.items():
        for index, pair in enumerate(zip(keys, step.tables[req_id], strict=False)):
            owners.setdefault(pair, []).append((req_id, index))
    scheduled = step.output.num_scheduled_tokens
    for load in step.meta.loads:
        slots = owners.get((load.key, load.block_id))
        assert slots, f"load of block {load.block_id} matches no scheduled request's block"
        assert any((index + 1) * BLOCK <= step.computed[req] for req, index in slots)
    for save in step.meta.saves:
        slots = owners.get((save.key, save.block_id))
        assert slots, f"save of block {save.block_id} matches no scheduled request's block"
        assert any((i + 1) * BLOCK <= step.computed[r] + scheduled[r] for r, i in slots)
    load_keys = {load.key for load in step.meta.loads}
    save_keys = [save.key for save in step.meta.saves]
    assert len(set(save_keys)) == len(save_keys)
    assert not load_keys & set(save_keys)
    for evicted in step.meta.evictions.values():
        assert not set(evicted) & (load_keys | set(save_keys))


def make_harness(
    model: str,
    tiers: list[dict[str, Any]],
    *,
    num_blocks: int = 200,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int = 1024,
    settings: dict[str, Any] | None = None,
    failure_policy: str = "fail",
    role: str = "kv_both",
    kv_events: bool = False,
) -> Harness:
    """Build vLLM's scheduler with ``UCMConnector`` over ``tiers`` (after vLLM's test utils).

    The KV cache layout is the tiny model's real one (one group of full attention
    layers), so the connector's estimate of a block's bytes is what a worker would hold.
    """
    plugin.register()
    init_none_hash(sha256)
    extra = {"tiers": tiers, **(settings or {})}
    model_config = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=4096)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=enable_prefix_caching
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="UCMConnector",
            kv_role=role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy=failure_policy,
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
    )
    assert not vllm_config.scheduler_config.async_scheduling
    parallel = vllm_config.parallel_config
    spec = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_size=model_config.get_head_size(),
        dtype=torch.float32,
    )
    layers = [
        f"model.layers.{i}.self_attn.attn" for i in range(model_config.get_num_layers(parallel))
    ]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )
    root = key_space(vllm_config, parse_config(extra)).root()
    posix = [index for index, tier in enumerate(tiers) if tier["backend"] == "posix"]
    store_tier = posix[0] if posix else None
    store = None if store_tier is None else PosixBackend(Path(tiers[store_tier]["path"]), 1 << 30)
    return Harness(scheduler, vllm_config, kv_cache_config, num_blocks, root, store, store_tier)
