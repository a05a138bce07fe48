"""ucm's ``mooncake`` tier on real vLLM engines and a real Mooncake Store on loopback.

The engines are clients that contribute no memory: a memory daemon holds the blocks,
so a second engine process, with its own DRAM tier and no shared directory, serves
what a first computed, exactly and with every expected hit. A negative control
replaces the stored blocks with random payloads under valid checksums.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import WORKLOAD
from ucm.store.base import BlockKey
from ucm.testing.engine import EngineSpec, Phase, run_engine
from ucm.testing.servers import MooncakeStore

pytestmark = pytest.mark.engine


def transfer(master: str, prefix: str, *, dram: bool = True, posix: Path | None = None) -> Any:
    tiers: list[dict[str, Any]] = [{"backend": "dram", "capacity": "64MiB"}] if dram else []
    if posix is not None:  # Only to learn the keys the engine stores (negative control).
        tiers.append({"backend": "posix", "path": str(posix), "capacity": "256MiB"})
    tiers.append(
        {"backend": "mooncake", "master": master, "capacity": "1GiB", "key_prefix": prefix}
    )
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": tiers},
        "kv_load_failure_policy": "recompute",
    }


def test_second_engine_reuses_what_the_first_computed(
    mooncake_store: MooncakeStore, tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    config = transfer(mooncake_store.master, "cross:")
    run_engine(EngineSpec(tiny_model, [Phase(WORKLOAD.cold)], 32, config), tmp_path / "writer")
    reader = EngineSpec(tiny_model, [Phase(WORKLOAD.warm, reset_before_each=True)], 32, config)
    warm = run_engine(reader, tmp_path / "reader")[0]
    assert warm.outputs == reference(32)
    assert warm.cached_tokens == WORKLOAD.expected_loaded(32)
    assert all(tokens > 0 for tokens in warm.cached_tokens)


def test_negative_control_corrupted_blocks_change_outputs(
    mooncake_store: MooncakeStore, tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    from ucm.store.mooncake import MooncakeBackend

    prefix, keys_dir = "negative:", tmp_path / "keys"
    writer = transfer(mooncake_store.master, prefix, dram=False, posix=keys_dir)
    run_engine(EngineSpec(tiny_model, [Phase(WORKLOAD.cold)], 32, writer), tmp_path / "w")
    files = sorted(keys_dir.rglob("*.blk"))
    assert files
    client = MooncakeBackend(mooncake_store.master, 1 << 30, key_prefix=prefix)
    rng = random.Random(0)
    for path in files:  # Random payloads under valid checksums: only the outputs can tell.
        key = BlockKey(bytes.fromhex(path.stem))
        size = path.stat().st_size - 64
        client.delete([key])
        assert client.dump([key], [[memoryview(rng.randbytes(size))]]).wait() == [True]
    client.close()
    reader = EngineSpec(
        tiny_model,
        [Phase(WORKLOAD.warm, reset_before_each=True)],
        32,
        transfer(mooncake_store.master, prefix, dram=False),
    )
    warm = run_engine(reader, tmp_path / "reader")[0]
    assert warm.cached_tokens == WORKLOAD.expected_loaded(32)
    assert warm.outputs != reference(32), "corrupted KV went unnoticed: the check cannot fail"
