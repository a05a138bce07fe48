"""ucm's ``redis`` tier on real vLLM engines and a real Valkey server on loopback.

Engines in separate processes, each with its own DRAM tier and no shared directory,
share blocks through the server: the second serves exactly what the first computed,
with the loaded tokens counted. A corrupted store must change the outputs (negative
control), and a server that goes away mid-run must cost hits, never requests.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_client

from tests.integration.conftest import WORKLOAD
from ucm.store.base import BlockKey
from ucm.store.blockfile import TRAILER_BYTES, Sealer
from ucm.testing.engine import EngineSpec, Phase, finish_engine, run_engine, start_engine
from ucm.testing.servers import ValkeyServer

pytestmark = pytest.mark.engine


def ucm_redis(url: str, prefix: str, dram: bool = True, **options: Any) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"backend": "dram", "capacity": "64MiB"}] if dram else []
    tiers.append(
        {"backend": "redis", "url": url, "capacity": "1GiB", "key_prefix": prefix, **options}
    )
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": tiers},
        "kv_load_failure_policy": "recompute",
    }


def stored_values(url: str, prefix: str) -> list[bytes]:
    return sorted(redis_client.Redis.from_url(url).keys(prefix.encode() + b"*"))


@pytest.mark.parametrize(
    ("cluster", "block_size", "in_place"),
    [
        (False, 32, True),
        (True, 32, True),
        # Staged pages of 64 KiB (per layer): sent from staging memory without a copy.
        (False, 128, False),
    ],
    ids=["standalone", "cluster", "standalone-large-values"],
)
def test_second_engine_reuses_what_the_first_computed(
    cluster: bool,
    block_size: int,
    in_place: bool,
    tiny_model: str,
    reference: Any,
    tmp_path: Path,
    valkey_server: ValkeyServer,
) -> None:
    prefix = f"cross-{cluster}-{block_size}:"
    with ValkeyServer(cluster=True) if cluster else _borrowed(valkey_server) as server:
        options = {"cluster": True} if cluster else {}
        transfer = ucm_redis(server.url, prefix, **options)
        transfer["kv_connector_extra_config"]["in_place"] = in_place
        writer = EngineSpec(tiny_model, [Phase(WORKLOAD.cold)], block_size, transfer)
        run_engine(writer, tmp_path / "writer")
        stored = stored_values(server.url, prefix)
        assert stored
        if not in_place:  # The values really are as large as the test means them to be.
            raw = redis_client.Redis.from_url(server.url)
            assert all(raw.strlen(name) >= (64 << 10) + TRAILER_BYTES for name in stored)
        reader = EngineSpec(
            tiny_model, [Phase(WORKLOAD.warm, reset_before_each=True)], block_size, transfer
        )
        warm = run_engine(reader, tmp_path / "reader")[0]
    assert warm.outputs == reference(block_size)
    assert warm.cached_tokens == WORKLOAD.expected_loaded(block_size)
    assert all(tokens > 0 for tokens in warm.cached_tokens)


def test_negative_control_corrupted_values_change_outputs(
    tiny_model: str, reference: Any, tmp_path: Path, valkey_server: ValkeyServer
) -> None:
    prefix = "negative:"
    transfer = ucm_redis(valkey_server.url, prefix, dram=False)
    run_engine(EngineSpec(tiny_model, [Phase(WORKLOAD.cold)], 32, transfer), tmp_path / "w")
    raw = redis_client.Redis.from_url(valkey_server.url)
    rng = random.Random(0)
    names = stored_values(valkey_server.url, prefix)
    assert names
    for name in names:  # Random payloads under valid checksums: only the outputs can tell.
        size = len(raw.get(name)) - TRAILER_BYTES
        payload = rng.randbytes(size)
        key = BlockKey(bytes.fromhex(name[len(prefix) :].decode()))
        raw.set(name, payload + Sealer().seal(key, [memoryview(payload)]).pack())
    reader = EngineSpec(tiny_model, [Phase(WORKLOAD.warm, reset_before_each=True)], 32, transfer)
    warm = run_engine(reader, tmp_path / "reader")[0]
    assert warm.cached_tokens == WORKLOAD.expected_loaded(32)
    assert warm.outputs != reference(32), "corrupted KV went unnoticed: the check cannot fail"


def test_engine_serves_while_the_server_is_away_and_hits_resume(
    tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    signals = {name: tmp_path / name for name in ("saved", "down", "served", "up")}
    server = ValkeyServer()
    server.start()
    try:
        transfer = ucm_redis(server.url, "away:", dram=False, timeout=0.5, retry_seconds=0.5)
        phases = [
            Phase(WORKLOAD.cold, signal=str(signals["saved"])),
            Phase(
                WORKLOAD.warm,
                reset_before_each=True,
                wait_for=str(signals["down"]),
                signal=str(signals["served"]),
            ),
            Phase(WORKLOAD.cold, wait_for=str(signals["up"]), settle_seconds=1.0),
            Phase(WORKLOAD.warm, reset_before_each=True),
        ]
        engine = start_engine(EngineSpec(tiny_model, phases, 32, transfer), tmp_path / "e")
        _wait_for(signals["saved"], engine)
        assert stored_values(server.url, "away:")
        server.stop()
        signals["down"].touch()
        _wait_for(signals["served"], engine)
        server.start()  # Empty, as after a crash: the cold phase stores the blocks again.
        signals["up"].touch()
        _, away, _, back = finish_engine(engine, tmp_path / "e")
    finally:
        server.close()
    assert away.outputs == reference(32)
    assert away.cached_tokens == [0] * len(WORKLOAD.warm)  # Every lookup missed.
    assert back.outputs == reference(32)
    assert back.cached_tokens == WORKLOAD.expected_loaded(32)
    log = (tmp_path / "e" / "engine.log").read_text()
    assert "unreachable" in log and "blocks are misses" in log


class _borrowed:
    """The session's server as a context manager that leaves it running."""

    def __init__(self, server: ValkeyServer) -> None:
        self.server = server

    def __enter__(self) -> ValkeyServer:
        return self.server

    def __exit__(self, *exc: object) -> None:
        pass


def _wait_for(path: Path, engine: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if engine.poll() is not None:
            raise RuntimeError(f"engine exited with {engine.returncode} before {path.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine did not reach {path.name}")
        time.sleep(0.1)
