"""Remote tiers in the data-path benchmark: ucm's ``redis`` and ``mooncake`` rates next
to what each server's own client achieves with the same bytes on the same server.

Each server runs on loopback for the measurement (a Valkey server, a Mooncake master
and memory daemon, as the tests start them); a server that is not installed here is
left out of the report with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy

from ucm.bench.datapath import Rate, backend_rates, best_rate
from ucm.testing.servers import MooncakeStore, ServerUnavailableError, ValkeyServer


def remote_rates(block_bytes: int, count: int) -> tuple[list[Rate], dict[str, float], list[str]]:
    """Measure every remote tier that can run here.

    Args:
        block_bytes: Size of one block.
        count: Blocks per batch.

    Returns:
        The rates, the ratios of ucm's rates to the raw client's, and why any tier was
        left out.
    """
    rates: list[Rate] = []
    ratios: dict[str, float] = {}
    skipped: list[str] = []
    for name, measure in (("redis", _redis), ("mooncake", _mooncake)):
        try:
            measured = measure(block_bytes, count)
        except ServerUnavailableError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        rates += measured
        rate = {entry.name: entry.gb_per_s for entry in measured}
        ratios[f"{name} save / raw client put"] = rate[f"{name} save"] / rate[f"{name} raw put"]
        ratios[f"{name} load / raw client get"] = rate[f"{name} load"] / rate[f"{name} raw get"]
    return rates, ratios, skipped


def _redis(block_bytes: int, count: int) -> list[Rate]:
    import redis

    from ucm.store.redis import RedisBackend

    with ValkeyServer(maxmemory=f"{4 * block_bytes * count + (64 << 20)}") as server:
        client = redis.Redis.from_url(server.url)
        # Distinct blocks, made beforehand, as an engine's would be (one repeated object
        # would stay in the CPU's caches and flatter the client).
        payloads = [os.urandom(block_bytes) for _ in range(count)]
        names = [f"raw:{i}" for i in range(count)]

        def put() -> None:
            with client.pipeline(transaction=False) as pipe:
                for name, payload in zip(names, payloads, strict=True):
                    pipe.set(name, payload)
                pipe.execute()

        def get() -> None:
            with client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.get(name)
                pipe.execute()

        raw = _raw_pair("redis", block_bytes, count, put, get, "pipelined SET/GET, redis-py")
        client.flushall()
        client.close()
        backend = RedisBackend(server.url, block_bytes)
        try:
            return [*raw, *backend_rates("redis", backend, block_bytes, count)]
        finally:
            backend.close()


def _mooncake(block_bytes: int, count: int) -> list[Rate]:
    from ucm.store.mooncake import MooncakeBackend

    memory = f"{(6 * block_bytes * count + (64 << 20)) >> 20} MB"
    with MooncakeStore(memory=memory) as store:
        staging = max(32 << 20, 2 * block_bytes)
        backend = MooncakeBackend(store.master, block_bytes, staging_bytes=staging)
        try:
            client = backend._store  # The same client: its raw batch API, same buffers.
            buffer = numpy.frombuffer(os.urandom(block_bytes * count), numpy.uint8).copy()
            assert client.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
            pointers = [buffer.ctypes.data + i * block_bytes for i in range(count)]
            sizes = [block_bytes] * count
            batches = iter(range(1 << 30))
            names: list[list[str]] = []

            def put() -> None:
                batch = [f"raw:{next(batches)}:{i}" for i in range(count)]
                names.append(batch)
                assert all(code == 0 for code in client.batch_put_from(batch, pointers, sizes))

            def get() -> None:
                got = client.batch_get_into(names[-1], pointers, sizes)
                assert all(size == block_bytes for size in got)

            note = "batch_put_from/batch_get_into, registered buffer"
            raw = _raw_pair("mooncake", block_bytes, count, put, get, note)
            client.batch_remove([name for batch in names for name in batch], True)
            client.unregister_buffer(buffer.ctypes.data)
            return [*raw, *backend_rates("mooncake", backend, block_bytes, count)]
        finally:
            backend.close()


def _raw_pair(
    name: str,
    block_bytes: int,
    count: int,
    put: Callable[[], None],
    get: Callable[[], None],
    how: str,
) -> list[Rate]:
    total = block_bytes * count
    note = f"{count} blocks of {block_bytes >> 10} KiB, {how}"
    put_rate = best_rate(total, put)
    return [
        Rate(f"{name} raw put", put_rate, note),
        Rate(f"{name} raw get", best_rate(total, get), note),
    ]
