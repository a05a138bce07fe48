"""Data-path micro-benchmark: ucm's transfer rates next to the machine's own limits.

Measured side by side in one run, so that ratios stay meaningful on a noisy machine:
memory copy bandwidth, sequential disk write/read bandwidth on the store's filesystem,
ucm's ``dram`` and ``posix`` save/load rates for blocks of a given size (and the
``redis`` and ``mooncake`` ones next to their servers' own clients), the
gather/scatter rate between a paged KV tensor and staging rows, the worker's load
path (reader threads reading straight into KV pages), and the scheduler's
lookup cost for a long prompt against an index of a million stored blocks.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ucm.integration.vllm.residency import MirroredTier, SharedTier, TierView, stored_prefix
from ucm.keys import KeyChain
from ucm.store.base import Backend, BlockKey
from ucm.store.blockfile import Sealer
from ucm.store.dram import DramBackend
from ucm.store.posix import PosixBackend
from ucm.store.posix_direct import aligned_buffer, direct_flag, probe
from ucm.transfer.paged import PagedKV
from ucm.transfer.reader import BlockRead, BlockReader
from ucm.transfer.streams import copy_stream

_CHUNK = 4 << 20


@dataclass(frozen=True)
class Rate:
    """One measured transfer rate."""

    name: str
    """What was measured."""
    gb_per_s: float
    """Best rate over the repeats, in 10^9 bytes per second."""
    note: str = ""
    """Conditions worth knowing (page cache state, sizes)."""


def best_seconds(run: Callable[[], None], repeats: int = 3) -> float:
    """Run ``run`` ``repeats`` times and return the shortest time in seconds."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def best_rate(nbytes: int, run: Callable[[], None], repeats: int = 3) -> float:
    """Run ``run`` ``repeats`` times and return the best rate in GB/s for ``nbytes``."""
    return nbytes / best_seconds(run, repeats) / 1e9


def _assert_all_found(keys: list[BlockKey], tier: TierView) -> None:
    assert len(stored_prefix(keys, [tier])) == len(keys)


def memory_copy(nbytes: int) -> Rate:
    """Measure copying between two already-touched host buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)

    def copy() -> None:
        dst.copy_(src)

    copy()  # Touch every page first: first-touch faults are not copy bandwidth.
    return Rate("memory copy", best_rate(nbytes, copy), f"{nbytes >> 20} MiB")


def checksum_rate(nbytes: int) -> Rate:
    """Measure the block checksum (xxh3-128) that every ``posix`` save and load computes."""
    data = memoryview(bytearray(b"\1") * nbytes)
    sealer = Sealer()
    key = BlockKey(bytes(32))

    def seal() -> None:
        sealer.seal(key, [data])

    return Rate("block checksum", best_rate(nbytes, seal), "xxh3-128")


def disk_sequential(directory: Path, nbytes: int) -> list[Rate]:
    """Measure sequential writes (buffered, and with fsync) and reads of one file.

    Caches cannot be dropped here: the read follows the write and is served by the
    page cache where the file fits, and the notes say so. The read fills a buffer as
    large as the file, as loads fill distinct KV pages: a small buffer read into again
    and again would stay in the CPU's caches and flatter the limit.
    """
    path = directory / "ucm-bench-disk.tmp"
    chunk = memoryview(os.urandom(_CHUNK))
    sink = memoryview(bytearray(b"\1") * nbytes)  # Touched: no first-touch faults.

    def write(sync: bool) -> None:
        with open(path, "wb", buffering=0) as file:
            for _ in range(nbytes // _CHUNK):
                file.write(chunk)
            if sync:
                os.fsync(file.fileno())

    def read() -> None:
        with open(path, "rb", buffering=0) as file:
            offset = 0
            while offset < nbytes and (count := file.readinto(sink[offset : offset + _CHUNK])):
                offset += count

    size = f"{nbytes >> 20} MiB file"
    try:
        buffered = best_rate(nbytes, lambda: write(False))
        synced = best_rate(nbytes, lambda: write(True), repeats=2)
        read_rate = best_rate(nbytes, read)
    finally:
        path.unlink(missing_ok=True)
    return [
        Rate("disk write (page cache)", buffered, size),
        Rate("disk write+fsync", synced, size),
        Rate("disk read", read_rate, f"{size}, warm page cache"),
    ]


def disk_direct(directory: Path, nbytes: int) -> list[Rate]:
    """Measure sequential ``O_DIRECT`` writes and reads of one file: the storage's own
    rate, with no page cache on either side.

    Raises:
        ValueError: The filesystem does not support ``O_DIRECT``.
    """
    probe(directory)
    path = directory / "ucm-bench-direct.tmp"
    chunk = aligned_buffer(_CHUNK)
    chunk[:] = os.urandom(_CHUNK)

    def transfer(flags: int, call: Callable[[int, list[memoryview], int], int]) -> None:
        fd = os.open(path, flags | direct_flag(), 0o600)
        try:
            for offset in range(0, nbytes // _CHUNK * _CHUNK, _CHUNK):
                assert call(fd, [chunk], offset) == _CHUNK
        finally:
            os.close(fd)

    size = f"{nbytes >> 20} MiB file"
    try:
        write = best_rate(nbytes, lambda: transfer(os.O_WRONLY | os.O_CREAT, os.pwritev))
        read = best_rate(nbytes, lambda: transfer(os.O_RDONLY, os.preadv))
    finally:
        path.unlink(missing_ok=True)
    return [
        Rate("disk write (O_DIRECT)", write, f"{size}, 4 MiB writes"),
        Rate("disk read (O_DIRECT)", read, f"{size}, 4 MiB reads, no page cache"),
    ]


def row_payloads(rows: torch.Tensor) -> list[list[memoryview]]:
    """Return each row of a contiguous host uint8 tensor as a one-segment payload."""
    array = rows.numpy()
    return [[memoryview(array[index])] for index in range(array.shape[0])]


def backend_rates(name: str, backend: Backend, block_bytes: int, count: int) -> tuple[Rate, Rate]:
    """Measure saving then loading ``count`` blocks through a backend's batch API."""
    rows = torch.randint(0, 255, (count, block_bytes), dtype=torch.uint8)
    out = torch.zeros_like(rows)
    keys: list[list[BlockKey]] = []

    def dump() -> None:
        batch = [BlockKey(os.urandom(32)) for _ in range(count)]
        keys.append(batch)
        assert all(backend.dump(batch, row_payloads(rows)).wait())

    def load() -> None:
        assert all(backend.load(keys[-1], row_payloads(out)).wait())

    total = count * block_bytes
    note = f"{count} blocks of {block_bytes >> 10} KiB"
    return (
        Rate(f"{name} save", best_rate(total, dump), note),
        Rate(f"{name} load", best_rate(total, load), note),
    )


def transfer_rates(
    device: torch.device, block_bytes: int, count: int, num_layers: int = 8
) -> tuple[list[Rate], dict[str, float]]:
    """Measure the staging path on ``device`` next to the plain copy of the same bytes.

    Gathers copy random blocks of a paged KV cache on ``device`` (CPU layout, any layer
    count) into staging memory, pinned on an accelerator, through the worker's copy
    stream; scatters copy them back into other blocks. Next to them, torch copies one
    contiguous buffer of as many bytes between the staging memory and the device: the
    host↔device bandwidth on an accelerator, a memory copy on the CPU.

    Returns:
        The four rates, and the gather and scatter rates as fractions of the plain copy.
    """
    heads, block_size = 8, 32
    content = block_bytes // num_layers // (heads * block_size * 4)
    layers = [
        (f"layer.{i}", torch.randn(2 * count, heads, block_size, content, device=device), 0)
        for i in range(num_layers)
    ]
    paged = PagedKV(layers)
    stream = copy_stream(device)
    rows = torch.empty(
        (count, paged.block_bytes), dtype=torch.uint8, pin_memory=device.type != "cpu"
    )
    flat = rows.view(-1)
    on_device = torch.empty_like(flat, device=device)
    sources = torch.randperm(2 * count)[:count].tolist()
    targets = sorted(set(range(2 * count)) - set(sources))

    def synchronize() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    def to_device() -> None:
        on_device.copy_(flat, non_blocking=True)
        synchronize()

    def to_host() -> None:
        flat.copy_(on_device, non_blocking=True)
        synchronize()

    def gather() -> None:
        stream.follow_compute()
        for layer in paged.layers:
            stream.run(functools.partial(paged.gather, layer, sources, rows, count))
        stream.record().synchronize()

    def scatter() -> None:
        stream.follow_compute()
        for layer in paged.layers:
            stream.run(functools.partial(paged.scatter, layer, targets, rows, count))
        stream.make_compute_wait(stream.record())
        synchronize()

    total = count * paged.block_bytes
    note = f"{count} random blocks of {paged.block_bytes >> 10} KiB, {num_layers} layers, {device}"
    plain = f"{total >> 20} MiB, torch, {device}"
    rates = [
        Rate("copy to the KV device", best_rate(total, to_device), plain),
        Rate("copy from the KV device", best_rate(total, to_host), plain),
        Rate("gather", best_rate(total, gather), note),
        Rate("scatter", best_rate(total, scatter), note),
    ]
    rate = {entry.name: entry.gb_per_s for entry in rates}
    ratios = {
        "gather / copy from the KV device": rate["gather"] / rate["copy from the KV device"],
        "scatter / copy to the KV device": rate["scatter"] / rate["copy to the KV device"],
    }
    return rates, ratios


def in_place_rates(
    name: str, backend: Backend, block_bytes: int, count: int, threads: int
) -> list[Rate]:
    """Measure the worker's load path: blocks read straight into the pages of an
    8-layer CPU paged KV cache by the reader threads, and saved from those pages."""
    heads, block_size, num_layers = 8, 32, 8
    content = block_bytes // num_layers // (heads * block_size * 4)
    layers = [
        (f"layer.{i}", torch.randn(2 * count, heads, block_size, content), 0)
        for i in range(num_layers)
    ]
    paged = PagedKV(layers)
    sources = paged.block_pages(range(count))
    targets = paged.block_pages(range(count, 2 * count))
    total = count * paged.block_bytes
    note = f"{count} blocks of {paged.block_bytes >> 10} KiB, {num_layers} layers"
    keys: list[BlockKey] = []

    def save() -> None:
        keys[:] = [BlockKey(os.urandom(32)) for _ in range(count)]
        assert all(backend.dump(keys, sources).wait())

    rates = [Rate(f"{name} save from pages", best_rate(total, save), note)]
    for workers in sorted({1, threads}):
        reader = BlockReader(workers)
        reads = [BlockRead(key, 0, payload) for key, payload in zip(keys, targets, strict=True)]

        def load(reader: BlockReader = reader, reads: list[BlockRead] = reads) -> None:
            assert all(reader.start([backend], reads).wait())

        rate = best_rate(total, load)
        rates.append(Rate(f"{name} load into pages, {workers} threads", rate, note))
        reader.close()
    return rates


def lookup_micros(
    store_dir: Path, prompt_tokens: int, stored_blocks: int, block_size: int
) -> dict[str, float]:
    """Time the scheduler's work for one long prompt that is stored in full.

    Args:
        store_dir: Where to put a ``posix`` store holding the prompt's blocks.
        prompt_tokens: Prompt length.
        stored_blocks: Blocks in the DRAM index besides the prompt's.
        block_size: Tokens per block.

    Returns:
        Microseconds to compute the prompt's keys and to find its stored prefix in a
        DRAM mirror of ``stored_blocks`` blocks, and in a ``posix`` store (holding the
        prompt's blocks only) through its in-memory index and through ``stat``.
    """
    tokens = list(range(prompt_tokens))
    keys: list[BlockKey] = []

    def hash_prompt() -> None:
        keys[:] = KeyChain(b"\0" * 32, block_size).extend(tokens)

    hashing = best_seconds(hash_prompt)
    mirror = MirroredTier(stored_blocks + len(keys))
    for _ in range(stored_blocks):
        mirror.admit(BlockKey(os.urandom(32)), step=0)
    for key in keys:
        mirror.admit(key, step=0)
    posix = PosixBackend(store_dir / "lookup", 1 << 40, index_refresh_seconds=0)
    payload = memoryview(bytearray(64))
    posix.dump(keys, [[payload]] * len(keys)).wait()
    indexed = SharedTier(PosixBackend(store_dir / "lookup", 1 << 40), 1)
    timings = {"key hashing (us)": hashing * 1e6}
    views = (
        ("dram", mirror),
        ("posix, in-memory index", indexed),
        ("posix, stat", SharedTier(posix, 1)),
    )
    for name, tier in views:
        seconds = best_seconds(functools.partial(_assert_all_found, keys, tier))
        timings[f"{name} prefix lookup (us)"] = seconds * 1e6
    indexed.close()
    shutil.rmtree(store_dir / "lookup", ignore_errors=True)
    return timings


def run(
    store_dir: Path,
    block_bytes: int = 1 << 20,
    count: int = 256,
    disk_bytes: int = 1 << 30,
    index_blocks: int = 1_000_000,
    threads: int = 4,
    remote: bool = True,
) -> dict[str, object]:
    """Run every measurement and return them as one JSON-ready mapping.

    Args:
        store_dir: A scratch directory on the filesystem the ``posix`` tier would use.
        block_bytes: Size of one stored block.
        count: Blocks per batch.
        disk_bytes: Size of the file for the raw disk measurements.
        index_blocks: Blocks in the DRAM index the lookup is timed against.
        threads: Reader threads for the in-place loads (ucm's ``io_threads``).
        remote: Also measure the ``redis`` and ``mooncake`` tiers against their servers'
            own clients, on servers started on loopback (where they are installed).
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    total = block_bytes * count
    rates = [memory_copy(total), checksum_rate(total), *disk_sequential(store_dir, disk_bytes)]
    # A pool of one batch: from the second batch on it is full and recycles evicted
    # blocks' memory, the steady state of a serving engine.
    rates += backend_rates("dram", DramBackend(total), block_bytes, count)
    posix_dir = store_dir / "posix"
    rates += backend_rates("posix", PosixBackend(posix_dir, 4 * total), block_bytes, count)
    shutil.rmtree(posix_dir, ignore_errors=True)
    unverified = PosixBackend(posix_dir, 4 * total, verify=False)
    load = backend_rates("posix", unverified, block_bytes, count)[1]
    rates.append(Rate("posix load, verify off", load.gb_per_s, load.note))
    shutil.rmtree(posix_dir, ignore_errors=True)
    skipped: list[str] = []
    try:
        rates += disk_direct(store_dir, disk_bytes)
        direct = backend_rates(
            "posix", PosixBackend(posix_dir, 4 * total, direct_io=True), block_bytes, count
        )
        rates += [
            Rate(f"{r.name} (direct_io)", r.gb_per_s, f"{r.note}, no page cache") for r in direct
        ]
    except ValueError as exc:
        skipped.append(str(exc))
    shutil.rmtree(posix_dir, ignore_errors=True)
    device = torch.accelerator.current_accelerator() or torch.device("cpu")
    staging, staging_ratios = transfer_rates(device, block_bytes, min(count, 128))
    rates += staging
    rates += in_place_rates("dram", DramBackend(total), block_bytes, count, threads)
    posix = PosixBackend(posix_dir, 4 * total)
    rates += in_place_rates("posix", posix, block_bytes, count, threads)
    shutil.rmtree(posix_dir, ignore_errors=True)
    rate = {entry.name: entry.gb_per_s for entry in rates}
    ratios = {
        "dram save / memory copy": rate["dram save"] / rate["memory copy"],
        "dram load / memory copy": rate["dram load"] / rate["memory copy"],
        "posix save / disk write (page cache)": rate["posix save"]
        / rate["disk write (page cache)"],
        "posix load / disk read": rate["posix load"] / rate["disk read"],
        "posix load / posix load with verify off": rate["posix load"]
        / rate["posix load, verify off"],
        "dram save from pages / memory copy": rate["dram save from pages"] / rate["memory copy"],
        f"dram load into pages ({threads} threads) / memory copy": rate[
            f"dram load into pages, {threads} threads"
        ]
        / rate["memory copy"],
        f"posix load into pages ({threads} threads) / disk read": rate[
            f"posix load into pages, {threads} threads"
        ]
        / rate["disk read"],
    }
    if "disk read (O_DIRECT)" in rate:
        ratios["posix save (direct_io) / disk write (O_DIRECT)"] = (
            rate["posix save (direct_io)"] / rate["disk write (O_DIRECT)"]
        )
        ratios["posix load (direct_io) / disk read (O_DIRECT)"] = (
            rate["posix load (direct_io)"] / rate["disk read (O_DIRECT)"]
        )
    ratios.update(staging_ratios)
    if remote:
        from ucm.bench.remote import remote_rates

        remote_measured, remote_ratios, remote_skipped = remote_rates(block_bytes, count)
        rates += remote_measured
        ratios.update(remote_ratios)
        skipped += remote_skipped
    return {
        "rates": [rate.__dict__ for rate in rates],
        "ratios": ratios,
        "lookup": lookup_micros(store_dir, 32 * 1024, index_blocks, 32),
        "skipped": skipped,
    }


def markdown(results: dict[str, object]) -> str:
    """Render :func:`run`'s results as a Markdown report."""
    lines = ["| measurement | GB/s | conditions |", "| --- | ---: | --- |"]
    rates = results["rates"]
    assert isinstance(rates, list)
    lines += [f"| {r['name']} | {r['gb_per_s']:.2f} | {r['note']} |" for r in rates]
    ratios = results["ratios"]
    assert isinstance(ratios, dict)
    lines += ["", "| ratio | value |", "| --- | ---: |"]
    lines += [f"| {name} | {value:.2f} |" for name, value in ratios.items()]
    lookup = results["lookup"]
    assert isinstance(lookup, dict)
    lines += ["", "| scheduler work, 32k-token prompt, 1M stored blocks | µs |", "| --- | ---: |"]
    lines += [f"| {name.removesuffix(' (us)')} | {value:.0f} |" for name, value in lookup.items()]
    skipped = results.get("skipped") or []
    assert isinstance(skipped, list)
    lines += ["", *[f"Not measured: {reason}" for reason in skipped]] if skipped else []
    return "\n".join(lines) + "\n"
