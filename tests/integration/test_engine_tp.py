"""ucm at tensor parallelism 2 on real vLLM engines (CPU backend, one core per rank).

Each rank stores its own shard of every block under a rank-specific key, so a fresh
TP=2 engine serves what another saved, token-identical to TP=2 without ucm, and a TP=1
engine never loads TP=2 shards as if they were whole blocks (vLLM's ExampleConnector
fails exactly this: its keys carry no rank).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import WORKLOAD
from ucm.testing.engine import EngineSpec, Phase, run_engine

pytestmark = pytest.mark.engine


def posix(store: Path, dram: bool = True) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"backend": "dram", "capacity": "64MiB"}] if dram else []
    tiers.append({"backend": "posix", "path": str(store), "capacity": "256MiB"})
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": tiers},
    }


@pytest.fixture(scope="module")
def reference_tp2(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    spec = EngineSpec(tiny_model, [Phase(WORKLOAD.warm)], 32, tensor_parallel_size=2)
    return run_engine(spec, tmp_path_factory.mktemp("reference-tp2"))[0].outputs


def test_tp2_store_serves_a_fresh_tp2_engine_and_never_a_tp1_one(
    tiny_model: str,
    reference: Callable[[int], list[list[int]]],
    reference_tp2: list[list[int]],
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    writer = EngineSpec(
        tiny_model, [Phase(WORKLOAD.cold)], 32, posix(store), tensor_parallel_size=2
    )
    run_engine(writer, tmp_path / "writer")
    blocks = list(store.rglob("*.blk"))
    assert blocks and len(blocks) % 2 == 0  # One file per rank's shard of each block.
    warm = [Phase(WORKLOAD.warm, reset_before_each=True)]
    reader = EngineSpec(tiny_model, warm, 32, posix(store), tensor_parallel_size=2)
    served = run_engine(reader, tmp_path / "reader")[0]
    assert served.outputs == reference_tp2
    assert served.cached_tokens == WORKLOAD.expected_loaded(32)
    consumer = {**posix(store), "kv_role": "kv_consumer"}  # Loads only: no hits of its own.
    single = run_engine(EngineSpec(tiny_model, warm, 32, consumer), tmp_path / "tp1")[0]
    assert single.cached_tokens == [0] * len(WORKLOAD.warm)
    assert single.outputs == reference(32)


def test_tp2_damaged_shards_are_recomputed_and_saved_again_exactly(
    tiny_model: str, reference_tp2: list[list[int]], tmp_path: Path
) -> None:
    """Damaged shards at TP=2 (about one of each block's two) are recomputed exactly,
    and what the engine saved meanwhile serves a second pass exactly. (Where one rank's
    shard fails and the other's loads, that rank computed the rest of the step on bad
    activations without knowing it; the scheduler deletes every rank's shard of such
    blocks so that they are saved anew.)"""
    store = tmp_path / "store"
    heads = [prompt[: 4 * 32 + 1] for prompt in WORKLOAD.cold]  # Store 4 blocks each.
    writer = EngineSpec(tiny_model, [Phase(heads, 1)], 32, posix(store), tensor_parallel_size=2)
    run_engine(writer, tmp_path / "w")
    shards = sorted(store.rglob("*.blk"))
    for path in shards[::2]:  # About one shard of each block: the other rank loads fine.
        with path.open("r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    # posix alone: a DRAM tier would serve the second phase from its own fresh copies.
    transfer = {**posix(store, dram=False), "kv_load_failure_policy": "recompute"}
    phases = [Phase(WORKLOAD.warm, reset_before_each=True)] * 2
    spec = EngineSpec(tiny_model, phases, 32, transfer, tensor_parallel_size=2)
    first, again = run_engine(spec, tmp_path / "reader")
    assert "Recovered from KV load failure" in (tmp_path / "reader" / "engine.log").read_text()
    assert first.outputs == reference_tp2
    assert all(tokens > 4 * 32 for tokens in again.cached_tokens)  # What phase 1 saved.
    assert again.outputs == reference_tp2
