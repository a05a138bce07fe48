"""A platform plugin's wrapper around ``UCMConnector``, shaped like the one ucm must serve.

It mirrors seed ``000_*`` (vllm-ascend's ``UCMConnectorV1``): it constructs
``UCMConnector(vllm_config, role)`` without ``kv_cache_config`` and forwards only the
methods below, never ``register_kv_caches``, ``get_finished``,
``update_connector_output`` or ``shutdown``. Tests run vLLM with it to prove ucm
stays exact and leak-free under such a wrapper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ucm.integration.vllm.ucm_connector import UCMConnector

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class UCMConnectorV1(KVConnectorBase_V1):
    """Forwards the subset of the connector interface that seed ``000_*`` forwards."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        """Build the wrapped connector the way the platform plugin does."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._ucm_engine = UCMConnector(vllm_config, role)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Forward."""
        self._ucm_engine.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forward."""
        self._ucm_engine.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Forward."""
        self._ucm_engine.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        """Forward."""
        self._ucm_engine.wait_for_save()

    def clear_connector_metadata(self) -> None:
        """Forward."""
        self._ucm_engine.clear_connector_metadata()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Forward."""
        self._ucm_engine.bind_connector_metadata(connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Forward."""
        return self._ucm_engine.get_block_ids_with_load_errors()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Forward."""
        return self._ucm_engine.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Forward."""
        self._ucm_engine.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Forward."""
        return self._ucm_engine.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forward."""
        return self._ucm_engine.request_finished(request, block_ids)
