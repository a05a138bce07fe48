"""What ucm derives from vLLM's configuration: the key space and the size of a block.

Both halves of the connector (scheduler and worker) call these functions on the same
``VllmConfig``, so they agree on keys and on how many blocks a tier can hold without
exchanging messages.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from ucm.config import UCMConfig
from ucm.keys import KeySpace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def key_space(vllm_config: VllmConfig, config: UCMConfig) -> KeySpace:
    """Build the key space of an engine.

    Args:
        vllm_config: The engine's configuration.
        config: ucm's configuration (for ``model_id``).

    Returns:
        The key space shared by every block this engine stores or loads.
    """
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    backend = vllm_config.attention_config.backend
    return KeySpace(
        model_id=config.model_id or str(model.model),
        revision=str(model.revision or ""),
        architecture=",".join(model.architectures or []),
        dtype=str(model.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        block_size=int(cache.block_size),
        num_layers=int(model.get_total_num_hidden_layers()),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=int(model.get_head_size()),
        use_mla=bool(model.use_mla),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        pipeline_parallel_size=int(parallel.pipeline_parallel_size),
        device=str(vllm_config.device_config.device_type),
        attention_backend="" if backend is None else str(backend.name),
        quantization=str(model.quantization or ""),
        speculative=_speculative(vllm_config),
        model_config_digest=_config_digest(model.hf_config.to_dict()),
    )


def _speculative(vllm_config: VllmConfig) -> str:
    spec = vllm_config.speculative_config
    if spec is None:
        return ""
    draft = spec.draft_model_config.model if spec.draft_model_config is not None else ""
    return f"{spec.method}:{draft}:{spec.num_speculative_tokens}"


_LOCAL_CONFIG_FIELDS = ("_name_or_path", "_commit_hash", "transformers_version")


def _config_digest(config: dict[str, Any]) -> str:
    """Digest the model configuration, leaving out fields that name where it came from."""
    kept = {key: value for key, value in config.items() if key not in _LOCAL_CONFIG_FIELDS}
    encoded = json.dumps(kept, sort_keys=True, default=str).encode()
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()


def num_shards(vllm_config: VllmConfig) -> int:
    """Return into how many distinct shards the ranks split every block.

    Each tensor- and pipeline-parallel rank holds its own shard (TP x PP), except with
    MLA, where every tensor-parallel rank holds the same latent KV (PP shards).
    """
    parallel = vllm_config.parallel_config
    tensor = 1 if vllm_config.model_config.use_mla else parallel.tensor_parallel_size
    return int(tensor * parallel.pipeline_parallel_size)


def rank_shard(vllm_config: VllmConfig, tp_rank: int, pp_rank: int) -> tuple[int, bool]:
    """Return the shard a rank holds, and whether it writes it to shared tiers.

    With MLA only the first tensor-parallel rank of each pipeline stage writes the
    shard the stage's ranks all hold (and all of them load it); otherwise every rank
    writes its own.

    Args:
        vllm_config: The engine's configuration.
        tp_rank: The rank within its tensor-parallel group.
        pp_rank: The rank within its pipeline-parallel group.
    """
    if vllm_config.model_config.use_mla:
        return pp_rank, tp_rank == 0
    return pp_rank * int(vllm_config.parallel_config.tensor_parallel_size) + tp_rank, True


def estimated_block_bytes(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    """Estimate the bytes one rank stores per block, from configuration alone.

    The worker measures the exact size from its KV tensors; the scheduler, which
    never sees tensors, uses this estimate to turn byte capacities into block counts.

    Args:
        vllm_config: The engine's configuration.
        kv_cache_config: vLLM's KV cache configuration, when the connector got one.

    Returns:
        Bytes per block per rank (at least 1).
    """
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        total = 0
        for group in kv_cache_config.kv_cache_groups:
            total += int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
        return max(total, 1)
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else torch.uint8
    element = torch.empty((), dtype=dtype).element_size()
    layers = model.get_num_layers(parallel)
    heads = 1 if model.use_mla else model.get_num_kv_heads(parallel)
    kv_parts = 1 if model.use_mla else 2
    per_layer = kv_parts * int(cache.block_size) * heads * model.get_head_size() * element
    return max(int(per_layer * layers), 1)
