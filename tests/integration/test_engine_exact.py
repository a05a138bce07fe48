"""ucm on a real vLLM engine: token-identical outputs, counted hits, a negative control.

Every engine runs in a fresh process on a model built at test time. Warm prompts run
after ``reset_prefix_cache()``, so every cached token they report came from ucm.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.workload import Workload, documents_workload
from ucm.store.base import BlockKey
from ucm.store.blockfile import TRAILER_BYTES, Sealer
from ucm.store.posix_fsck import fsck
from ucm.testing.engine import EngineSpec, Phase, finish_engine, run_engine, start_engine
from ucm.testing.pagecache import resident_fraction

pytestmark = pytest.mark.engine

WORKLOAD = documents_workload()


def tiers(kind: str, store: Path) -> list[dict[str, Any]]:
    chosen = {
        "dram": [{"backend": "dram", "capacity": "64MiB"}],
        "posix": [{"backend": "posix", "path": str(store), "capacity": "256MiB"}],
        "posix_direct": [
            {"backend": "posix", "path": str(store), "capacity": "256MiB", "direct_io": True}
        ],
    }
    return [tier for name in kind.split("+") for tier in chosen[name]]


def ucm(
    kind: str,
    store: Path,
    role: str = "kv_both",
    in_place: bool = True,
    async_load: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    settings = {"tiers": tiers(kind, store), "in_place": in_place, "async_load": async_load}
    return {
        "kv_connector": "UCMConnector",
        "kv_role": role,
        "kv_connector_extra_config": settings,
        **extra,
    }


def assert_exact_with_hits(
    outputs: list[list[int]], cached: list[int], reference: list[list[int]], block_size: int
) -> None:
    assert outputs == reference
    assert cached == WORKLOAD.expected_loaded(block_size)
    assert all(tokens > 0 for tokens in cached)


def save_cold_prompts(tiny_model: str, tmp_path: Path) -> Path:
    """Run the cold prompts in an engine with a posix tier; return the store directory."""
    store = tmp_path / "store"
    spec = EngineSpec(tiny_model, [Phase(WORKLOAD.cold)], 32, ucm("posix", store))
    run_engine(spec, tmp_path / "writer")
    return store


def cold_then_warm() -> list[Phase]:
    return [Phase(WORKLOAD.cold), Phase(WORKLOAD.warm, reset_before_each=True)]


@pytest.mark.parametrize(
    ("kind", "block_size", "in_place"),
    [
        ("dram", 32, True),
        ("posix", 32, True),
        ("posix_direct", 32, True),
        ("dram+posix", 32, True),
        ("dram+posix", 128, True),
        ("dram+posix", 32, False),  # Through staging rows, the GPU path.
    ],
)
def test_same_engine_after_prefix_cache_reset(
    kind: str, block_size: int, in_place: bool, tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    transfer = ucm(kind, tmp_path / "store", in_place=in_place)
    spec = EngineSpec(tiny_model, cold_then_warm(), block_size, transfer)
    warm = run_engine(spec, tmp_path / "engine")[1]
    assert_exact_with_hits(warm.outputs, warm.cached_tokens, reference(block_size), block_size)
    log = (tmp_path / "engine" / "engine.log").read_text()
    assert ("pages read and written in place" in log) == in_place
    # The first step with loads shows vLLM waits for every layer; later ones overlap.
    assert "loads now overlap the forward pass" in log


@pytest.mark.parametrize("in_place", [True, False])
def test_background_loads_from_disk(
    in_place: bool, tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    transfer = ucm("posix", tmp_path / "store", in_place=in_place, async_load=True)
    spec = EngineSpec(tiny_model, cold_then_warm(), 32, transfer)
    warm = run_engine(spec, tmp_path / "engine")[1]
    assert_exact_with_hits(warm.outputs, warm.cached_tokens, reference(32), 32)
    assert "loading blocks in the background" in (tmp_path / "engine" / "engine.log").read_text()


@pytest.mark.parametrize(
    ("kind", "block_size", "writer_role", "reader_role"),
    [
        ("posix", 32, "kv_both", "kv_both"),
        ("posix", 128, "kv_producer", "kv_consumer"),
        ("posix_direct", 32, "kv_both", "kv_both"),
    ],
)
def test_fresh_process_reads_what_another_saved(
    kind: str,
    block_size: int,
    writer_role: str,
    reader_role: str,
    tiny_model: str,
    reference: Any,
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    # The writer asks the cold prompts twice: the second time a loading role would hit.
    writer = EngineSpec(
        tiny_model,
        [Phase(WORKLOAD.cold), Phase(WORKLOAD.cold, reset_before_each=True)],
        block_size,
        ucm(kind, store, writer_role),
        env={"PYTHONHASHSEED": "1"},
    )
    again = run_engine(writer, tmp_path / "writer")[1]
    loads = writer_role != "kv_producer"
    assert all((tokens > 0) == loads for tokens in again.cached_tokens)
    stored = sorted(store.rglob("*.blk"))
    assert stored
    # Direct I/O leaves nothing in the page cache; buffered writes leave it all there.
    direct = kind == "posix_direct"
    assert (resident_fraction(stored) == 0.0) == direct
    reader = EngineSpec(
        tiny_model,
        [Phase(WORKLOAD.warm, reset_before_each=True)],
        block_size,
        ucm(kind, store, reader_role),
        env={"PYTHONHASHSEED": "2"},
    )
    warm = run_engine(reader, tmp_path / "reader")[0]
    assert_exact_with_hits(warm.outputs, warm.cached_tokens, reference(block_size), block_size)
    assert (resident_fraction(stored) == 0.0) == direct
    if reader_role == "kv_consumer":
        assert sorted(store.rglob("*.blk")) == stored  # A consumer never saves.


def test_two_live_engines_share_one_directory(
    tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    store, done = tmp_path / "store", tmp_path / "writer-done"
    writer = EngineSpec(
        tiny_model,
        [Phase(WORKLOAD.cold, signal=str(done))],
        kv_transfer_config=ucm("dram+posix", store),
    )
    reader = EngineSpec(
        tiny_model,
        # Blocks of other processes show in the reader's view of the store within
        # about one refresh of its index (1 s by default).
        [Phase(WORKLOAD.warm, reset_before_each=True, wait_for=str(done), settle_seconds=2.5)],
        kv_transfer_config=ucm("dram+posix", store),
    )
    # The reader starts (and scans the store) before the writer has saved anything.
    procs = [start_engine(writer, tmp_path / "w"), start_engine(reader, tmp_path / "r")]
    finish_engine(procs[0], tmp_path / "w")
    warm = finish_engine(procs[1], tmp_path / "r")[0]
    assert_exact_with_hits(warm.outputs, warm.cached_tokens, reference(32), 32)


@pytest.mark.parametrize(
    ("kind", "async_load"), [("posix", False), ("posix", True), ("posix_direct", False)]
)
def test_negative_control_corrupted_kv_changes_outputs(
    kind: str, async_load: bool, tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    store = save_cold_prompts(tiny_model, tmp_path)
    rng = random.Random(0)
    blocks = sorted(store.rglob("*.blk"))
    assert blocks
    for path in blocks:  # Random payloads under valid checksums: only the outputs can tell.
        payload = rng.randbytes(path.stat().st_size - TRAILER_BYTES)
        trailer = Sealer().seal(BlockKey(bytes.fromhex(path.stem)), [memoryview(payload)])
        path.write_bytes(payload + trailer.pack())
    transfer = ucm(kind, store, async_load=async_load)
    reader = EngineSpec(tiny_model, [Phase(WORKLOAD.warm, reset_before_each=True)], 32, transfer)
    warm = run_engine(reader, tmp_path / "reader")[0]
    assert warm.cached_tokens == WORKLOAD.expected_loaded(32)
    assert warm.outputs != reference(32), "corrupted KV went unnoticed: the check cannot fail"


def test_exact_under_platform_wrapper(tiny_model: str, reference: Any, tmp_path: Path) -> None:
    transfer = ucm(
        "dram+posix",
        tmp_path / "store",
        kv_connector="UCMConnectorV1",
        kv_connector_module_path="ucm.testing.platform_wrapper",
    )
    warm = run_engine(EngineSpec(tiny_model, cold_then_warm(), 32, transfer), tmp_path / "e")[1]
    assert_exact_with_hits(warm.outputs, warm.cached_tokens, reference(32), 32)


def test_exact_with_scheduler_and_worker_in_separate_processes(
    tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    spec = EngineSpec(
        tiny_model,
        cold_then_warm(),
        32,
        ucm("dram", tmp_path / "store"),
        multiprocessing=True,
    )
    warm = run_engine(spec, tmp_path / "engine")[1]
    assert_exact_with_hits(warm.outputs, warm.cached_tokens, reference(32), 32)


def test_workload_expectations_are_not_trivial() -> None:
    workload: Workload = WORKLOAD
    assert workload.expected_loaded(32) == [320, 320, 288, 288]
    assert workload.expected_loaded(128) == [256, 256, 256, 256]


def tear(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def flip_payload_bit(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.seek(path.stat().st_size // 3)
        byte = handle.read(1)[0]
        handle.seek(-1, 1)
        handle.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize(
    ("async_load", "damage"), [(False, tear), (True, tear), (False, flip_payload_bit)]
)
def test_damaged_blocks_are_recomputed_exactly(
    async_load: bool,
    damage: Callable[[Path], None],
    tiny_model: str,
    reference: Any,
    tmp_path: Path,
) -> None:
    store = save_cold_prompts(tiny_model, tmp_path)
    blocks = sorted(store.rglob("*.blk"))
    for path in blocks[::2]:  # Still listed, so lookups hit; reads find them damaged.
        damage(path)
    transfer = ucm("posix", store, async_load=async_load, kv_load_failure_policy="recompute")
    reader = EngineSpec(tiny_model, [Phase(WORKLOAD.warm, reset_before_each=True)], 32, transfer)
    warm = run_engine(reader, tmp_path / "reader")[0]
    assert warm.outputs == reference(32)
    log = (tmp_path / "reader" / "engine.log").read_text()
    assert "Recovered from KV load failure" in log  # The torn blocks really failed.
    # Each damaged file was removed and, once recomputed, its block saved again whole.
    sizes = {path.stat().st_size for path in store.rglob("*.blk")}
    assert sizes == {blocks[1].stat().st_size}, "a torn block is still stored"
    assert fsck(store).clean
    assert {path.name for path in blocks} <= {path.name for path in store.rglob("*.blk")}


def test_blocks_computed_in_a_step_whose_load_failed_are_not_saved(
    tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    """The step that loads a damaged block also computes the blocks after it, from
    garbage; vLLM recomputes them, but their first copies must not be stored."""
    store = tmp_path / "store"
    heads = [prompt[: 4 * 32 + 1] for prompt in WORKLOAD.cold]  # Store 4 blocks each.
    run_engine(EngineSpec(tiny_model, [Phase(heads, 1)], 32, ucm("posix", store)), tmp_path / "w")
    for path in store.rglob("*.blk"):
        tear(path)  # Half the page stays unread: a bit flip might not change the output.
    transfer = ucm("posix", store, kv_load_failure_policy="recompute")
    phases = [Phase(WORKLOAD.warm, reset_before_each=True)] * 2
    first, again = run_engine(EngineSpec(tiny_model, phases, 32, transfer), tmp_path / "reader")
    assert "Recovered from KV load failure" in (tmp_path / "reader" / "engine.log").read_text()
    assert first.outputs == reference(32)
    expected = WORKLOAD.expected_loaded(32)  # The blocks saved in the first phase.
    assert all(a >= e > 4 * 32 for a, e in zip(again.cached_tokens, expected, strict=True))
    assert again.outputs == reference(32)


def test_damaged_blocks_fail_requests_cleanly_by_default(
    tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    """vLLM's default policy fails the request; the engine serves on, exactly."""
    store = save_cold_prompts(tiny_model, tmp_path)
    for path in sorted(store.rglob("*.blk")):
        flip_payload_bit(path)
    # Without vLLM's prefix cache, the retry cannot reuse blocks of the failed attempt.
    phases = [Phase(WORKLOAD.warm, reset_before_each=True)] * 2
    spec = EngineSpec(tiny_model, phases, 32, ucm("posix", store), enable_prefix_caching=False)
    first, again = run_engine(spec, tmp_path / "reader")
    # The first request of each document fails; the blocks that failed are not offered
    # again, so later ones recompute them (and save them again): all of those succeed.
    failed = [reason == "error" for reason in first.finish_reasons]
    assert failed == [True, True, False, False], first.finish_reasons
    for index in (2, 3):
        assert first.outputs[index] == reference(32)[index]
    assert again.finish_reasons == ["length"] * len(WORKLOAD.warm)
    assert again.outputs == reference(32)
    assert all(again.cached_tokens), "the blocks saved again were not loaded"


def test_engine_killed_while_saving_leaves_a_store_that_serves_exactly(
    tiny_model: str, reference: Any, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    cold = Phase(WORKLOAD.cold * 3, max_tokens=32, reset_before_each=True)
    writer = start_engine(EngineSpec(tiny_model, [cold], 32, ucm("posix", store)), tmp_path / "w")
    deadline = time.monotonic() + 300
    while not list(store.rglob("*.blk")) and writer.poll() is None:
        assert time.monotonic() < deadline, "the writer never saved a block"
        time.sleep(0.05)
    time.sleep(random.Random(0).uniform(0.0, 0.5))
    writer.kill()  # SIGKILL, in the middle of saving.
    assert writer.wait() != 0, "the writer finished before it was killed"
    transfer = ucm("posix", store)
    reader = EngineSpec(tiny_model, [Phase(WORKLOAD.warm, reset_before_each=True)], 32, transfer)
    warm = run_engine(reader, tmp_path / "reader")[0]
    assert warm.outputs == reference(32)
    assert sum(warm.cached_tokens) > 0
    assert not list(store.rglob("*.tmp"))
    report = fsck(store)
    assert report.clean and report.blocks > 0


def test_full_disk_drops_saves_and_serves_exactly(
    tiny_model: str, reference: Any, small_filesystem: Path, tmp_path: Path
) -> None:
    """A 512 KiB filesystem under a 256 MiB posix tier: most saves fail with ENOSPC."""
    transfer = ucm("posix", small_filesystem / "store")
    warm_phase = Phase(WORKLOAD.warm, reset_before_each=True)
    spec = EngineSpec(tiny_model, [Phase(WORKLOAD.cold), warm_phase], 32, transfer)
    warm = run_engine(spec, tmp_path / "engine")[1]
    assert warm.outputs == reference(32)
    assert 0 < sum(warm.cached_tokens) < sum(WORKLOAD.expected_loaded(32))
    log = (tmp_path / "engine" / "engine.log").read_text()
    assert "No space left on device" in log
    assert not list(small_filesystem.rglob("*.tmp"))
