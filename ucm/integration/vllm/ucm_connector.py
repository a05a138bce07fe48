"""``UCMConnector``: vLLM's V1 KV connector for ucm, a thin facade dispatching by role.

The scheduler role builds :class:`~ucm.integration.vllm.scheduler.UCMScheduler`
(lookup, placement, per-step metadata; never touches tensors); the worker role
builds :class:`~ucm.integration.vllm.worker.UCMWorker` (moves blocks; never decides
eviction). By default saves are copied out of the paged buffer within the step that
computed the blocks, so ``request_finished`` holds no blocks back, which keeps ucm
exact and leak-free also under platform wrappers that forward only part of this
interface. ``async_save`` holds blocks of finished requests until ``get_finished``
reports them, and ``async_load`` resumes requests from it: both need vLLM to call
every hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ucm.config import parse_config
from ucm.integration.vllm.metadata import UCMConnectorMetadata
from ucm.integration.vllm.scheduler import UCMScheduler
from ucm.integration.vllm.stats import UCMPromMetrics, UCMStats
from ucm.integration.vllm.worker import UCMWorker

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # Under vLLM's configured logger tree.

_HIT_SOURCES = {
    "memory": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,  # vLLM's label for remote stores.
}


class UCMConnector(KVConnectorBase_V1):
    """Persistent, shared KV-cache tiers (DRAM, local disk, NFS, Redis/Valkey) for vLLM."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        """Parse ucm's settings and build the half of the connector for ``role``.

        Args:
            vllm_config: The engine's configuration; ucm's settings are its
                ``kv_transfer_config.kv_connector_extra_config``.
            role: Scheduler or worker.
            kv_cache_config: vLLM's KV cache layout (platform wrappers may omit it).

        Raises:
            ucm.config.ConfigError: A setting is wrong.
        """
        super().__init__(vllm_config, role, kv_cache_config)
        config = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: UCMScheduler | None = None
        self._worker: UCMWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = UCMScheduler(vllm_config, config, kv_cache_config)
        else:
            self._worker = UCMWorker(vllm_config, config, kv_cache_config)

    # ---- worker side -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the paged KV tensors (found lazily when a wrapper never calls this)."""
        self._worker_half().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Accept the scheduler half's instructions for this step."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, UCMConnectorMetadata)
        self._worker_half().bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Drop this step's instructions (finishing its loads if nothing did)."""
        super().clear_connector_metadata()
        try:
            self._worker_half().clear()
        except Exception:  # noqa: BLE001 - fault barrier: failed loads are reported as errors
            logger.exception("ucm: finishing this step's transfers failed")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start loading this step's blocks into the paged buffer; a failure becomes a
        load error."""
        worker = self._worker_half()
        try:
            worker.start_load_kv()
        except Exception:  # noqa: BLE001 - fault barrier: a bad load must mean recompute
            logger.exception("ucm: loading KV failed; the blocks will be reported as errors")
            worker.fail_pending_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the step's loads of this layer are in place; a failure becomes a
        load error."""
        worker = self._worker_half()
        try:
            worker.wait_for_layer_load(layer_name)
        except Exception:  # noqa: BLE001 - fault barrier: a bad load must mean recompute
            logger.exception("ucm: loading KV of %s failed; the blocks are recomputed", layer_name)
            worker.fail_pending_loads()

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        """Copy the layer's pages of the blocks being saved out of the paged buffer."""
        try:
            self._worker_half().save_kv_layer(layer_name)
        except Exception:  # noqa: BLE001 - fault barrier: a failed save is a future miss
            logger.exception("ucm: copying KV of %s failed; this step saves nothing", layer_name)
            self._worker_half().clear()

    def wait_for_save(self) -> None:
        """Write this step's saved blocks to their tiers."""
        try:
            self._worker_half().wait_for_save()
        except Exception:  # noqa: BLE001 - fault barrier: a failed save is a future miss
            logger.exception("ucm: saving KV failed; this step saves nothing")
            self._worker_half().clear()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report the finished requests whose writes from their pages are done
        (``async_save``), and the requests whose background loads are in place."""
        worker = self._worker_half()
        return worker.take_finished_sends() or None, worker.take_finished_loads() or None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Wait for the writes from the pages of preempted requests, which vLLM is
        about to reuse (``async_save``)."""
        assert isinstance(kv_connector_metadata, UCMConnectorMetadata)
        self._worker_half().wait_for_sends(kv_connector_metadata.preempted)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return the blocks whose load failed since the last call."""
        return self._worker_half().take_load_errors()

    def flush_saves(self) -> None:
        """Block until this worker's background writes to persistent tiers have finished."""
        self._worker_half().flush()

    def shutdown(self) -> None:
        """Close the tiers (worker side) and the tier views (scheduler side)."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- scheduler side ----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return how many more prompt tokens ucm can load for ``request``."""
        return self._scheduler_half().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load into the blocks vLLM just allocated."""
        self._scheduler_half().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Build this step's instructions for the worker half."""
        return self._scheduler_half().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn which loads failed, so that their blocks are not offered again."""
        self._scheduler_half().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; return whether vLLM must keep its blocks until
        ``get_finished`` reports it sent (``async_save`` writes from its pages)."""
        return self._scheduler_half().request_finished(request), None

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Label ucm's hits by where they came from: host memory, disk, or a remote store."""
        sources = self._scheduler_half().hit_sources(request, num_external_tokens)
        return {_HIT_SOURCES[medium]: tokens for medium, tokens in sources.items()}

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return KV events (blocks stored in and evicted from ucm's tiers) for routers."""
        return self._scheduler_half().take_events()

    # ---- statistics (both sides) ---------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Return this half's stats since the last call (vLLM sums them over workers)."""
        half = self._scheduler if self._scheduler is not None else self._worker
        assert half is not None
        return half.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Rebuild stats from their payload (vLLM aggregates and logs them)."""
        return UCMStats(data) if data else UCMStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """Register ucm's Prometheus metrics (``ucm:`` prefix) for ``vllm serve``."""
        return UCMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def tracked_requests(self) -> frozenset[str]:
        """Return the ids of requests the scheduler half holds state for (for leak checks)."""
        return self._scheduler_half().tracked_requests()

    def _scheduler_half(self) -> UCMScheduler:
        assert self._scheduler is not None, "scheduler-side method called on a worker"
        return self._scheduler

    def _worker_half(self) -> UCMWorker:
        assert self._worker is not None, "worker-side method called on the scheduler"
        return self._worker
