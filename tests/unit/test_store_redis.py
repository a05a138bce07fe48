"""Tests of the ``redis`` backend against real Valkey servers on loopback: conformance
(standalone and cluster), a server that evicts, one that goes away and comes back,
damaged and forged values, and configuration errors."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import redis as redis_client

from ucm.config import ConfigError, parse_config
from ucm.store.base import Backend
from ucm.store.blockfile import TRAILER_BYTES
from ucm.store.redis import RedisBackend
from ucm.testing.conformance import (
    BackendConformance,
    make_buffer,
    make_key,
    make_payload,
    views,
)
from ucm.testing.servers import ValkeyServer

_prefixes = itertools.count()
SECRET = b"0123456789abcdef-redis"


def fresh_prefix() -> str:
    """A key prefix no other backend of this session uses: an empty store."""
    return f"test{next(_prefixes)}:"


def raw_name(backend_prefix: str, index: int) -> bytes:
    return (backend_prefix + make_key(index).hex()).encode()


class TestRedisConformance(BackendConformance):
    exact_usage = False  # usage() reports the whole server's memory.

    @pytest.fixture(autouse=True)
    def _server(self, valkey_server: ValkeyServer) -> None:
        self.server = valkey_server

    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return RedisBackend(self.server.url, capacity_bytes, key_prefix=fresh_prefix())


@pytest.fixture(scope="module")
def cluster_server() -> Iterator[ValkeyServer]:
    with ValkeyServer(cluster=True) as server:
        yield server


class TestRedisClusterConformance(BackendConformance):
    exact_usage = False

    @pytest.fixture(autouse=True)
    def _server(self, cluster_server: ValkeyServer) -> None:
        self.server = cluster_server

    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return RedisBackend(
            self.server.url, capacity_bytes, cluster=True, key_prefix=fresh_prefix()
        )


def test_a_server_that_evicts_turns_blocks_into_misses() -> None:
    size, count = 64 << 10, 160  # 10 MiB of blocks into a 4 MB cache.
    with ValkeyServer(maxmemory="4mb") as server:
        backend = RedisBackend(server.url, 1 << 30, key_prefix=fresh_prefix())
        keys = [make_key(i) for i in range(count)]
        stored = backend.dump(keys, views([make_payload(i, size) for i in range(count)])).wait()
        assert all(stored)  # Accepted: the server evicts older blocks to make room.
        info = redis_client.Redis.from_url(server.url).info("memory")
        assert info["used_memory"] <= 4_000_000 + (1 << 20)
        held = backend.lookup(keys)
        assert 0 < sum(held) < count
        buffers = [make_buffer(size) for _ in range(count)]
        loaded = backend.load(keys, views(buffers)).wait()
        # Reading takes server memory too, so more blocks may vanish meanwhile.
        assert sum(loaded) > 0 and all(h for h, ok in zip(held, loaded, strict=True) if ok)
        for i, ok in enumerate(loaded):
            assert buffers[i] == (make_payload(i, size) if ok else make_buffer(size))
        assert backend.corrupt_blocks == 0
        backend.close()


@pytest.mark.timeout(60)
def test_a_server_that_goes_away_and_comes_back() -> None:
    server = ValkeyServer()
    server.start()
    try:
        backend = RedisBackend(
            server.url, 1 << 20, key_prefix=fresh_prefix(), timeout=1.0, retry_seconds=0.2
        )
        keys = [make_key(i) for i in range(4)]
        payloads = [make_payload(i, 1000) for i in range(4)]
        assert backend.dump(keys[:2], views(payloads[:2])).wait() == [True, True]
        server.stop()
        assert backend.lookup(keys) == [False] * 4
        buffers = [make_buffer(1000) for _ in range(2)]
        assert backend.load(keys[:2], views(buffers)).wait() == [False, False]
        assert buffers == [make_buffer(1000)] * 2
        assert backend.dump(keys[2:], views(payloads[2:])).wait() == [False, False]
        assert backend.dropped_writes == 2
        assert backend.usage().used_bytes == 0
        server.start()  # Empty: the server lost its data.
        while not all(backend.dump(keys, views(payloads)).wait()):
            pass  # Misses until retry_seconds passed since the last failure.
        buffers = [make_buffer(1000) for _ in range(4)]
        assert backend.load(keys, views(buffers)).wait() == [True] * 4
        assert buffers == payloads
        backend.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    "damage",
    ["flip a payload byte", "flip a trailer byte", "truncate", "swap with another key"],
)
def test_damaged_values_are_misses_and_removed(valkey_server: ValkeyServer, damage: str) -> None:
    prefix = fresh_prefix()
    backend = RedisBackend(valkey_server.url, 1 << 20, key_prefix=prefix)
    raw = redis_client.Redis.from_url(valkey_server.url)
    backend.dump([make_key(0), make_key(1)], views([make_payload(0, 500), make_payload(1, 500)]))
    name = raw_name(prefix, 0)
    value = bytearray(raw.get(name))
    if damage == "flip a payload byte":
        value[123] ^= 0x01
    elif damage == "flip a trailer byte":
        value[-TRAILER_BYTES + 20] ^= 0x01
    elif damage == "truncate":
        del value[-1]
    else:
        value = bytearray(raw.get(raw_name(prefix, 1)))
    raw.set(name, bytes(value))
    buffers = [make_buffer(500)]
    assert backend.load([make_key(0)], views(buffers)).wait() == [False]
    assert raw.exists(name) == 0  # Removed, so that it can be written again.
    assert backend.corrupt_blocks == 1
    assert backend.dump([make_key(0)], views([make_payload(0, 500)])).wait() == [True]
    assert backend.load([make_key(0)], views(buffers)).wait() == [True]
    assert buffers == [make_payload(0, 500)]
    backend.close()


def test_a_wrong_size_request_is_a_miss_not_damage(valkey_server: ValkeyServer) -> None:
    prefix = fresh_prefix()
    backend = RedisBackend(valkey_server.url, 1 << 20, key_prefix=prefix)
    backend.dump([make_key(0)], views([make_payload(0, 500)]))
    assert backend.load([make_key(0)], views([make_buffer(400)])).wait() == [False]
    assert backend.corrupt_blocks == 0
    assert backend.lookup([make_key(0)]) == [True]
    backend.close()


def test_a_writer_without_the_secret_cannot_get_its_blocks_served(
    valkey_server: ValkeyServer,
) -> None:
    prefix = fresh_prefix()
    signed = RedisBackend(valkey_server.url, 1 << 20, key_prefix=prefix, secret=SECRET)
    forger = RedisBackend(valkey_server.url, 1 << 20, key_prefix=prefix)
    assert forger.dump([make_key(0)], views([make_payload(0, 300)])).wait() == [True]
    assert signed.load([make_key(0)], views([make_buffer(300)])).wait() == [False]
    assert signed.dump([make_key(1)], views([make_payload(1, 300)])).wait() == [True]
    buffers = [make_buffer(300)]
    assert signed.load([make_key(1)], views(buffers)).wait() == [True]
    assert buffers == [make_payload(1, 300)]
    assert forger.load([make_key(1)], views([make_buffer(300)])).wait() == [False]
    signed.close()
    forger.close()


def test_password_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCM_TEST_REDIS_PASSWORD", "s3cret-pw")
    with ValkeyServer() as server:
        server.require_password("s3cret-pw")
        tier = {"backend": "redis", "capacity": "1MiB", "url": server.url}
        parsed = parse_config({"tiers": [{**tier, "password_env": "UCM_TEST_REDIS_PASSWORD"}]})
        with closing(RedisBackend.from_tier(parsed.tiers[0])) as backend:
            assert backend.dump([make_key(0)], views([make_payload(0, 100)])).wait() == [True]
            assert backend.lookup([make_key(0)]) == [True]
        anonymous = RedisBackend.from_tier(parse_config({"tiers": [tier]}).tiers[0])
        with closing(anonymous) as backend:  # Refused: misses and dropped writes, no raise.
            assert backend.lookup([make_key(0)]) == [False]
            assert backend.dump([make_key(1)], views([make_payload(1, 100)])).wait() == [False]
            assert backend.dropped_writes == 1
    monkeypatch.delenv("UCM_TEST_REDIS_PASSWORD")
    with pytest.raises(ValueError, match="password_env: variable 'UCM_TEST_REDIS_PASSWORD'"):
        RedisBackend.from_tier(parsed.tiers[0])


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.uri: unknown key for backend 'redis'"):
        parse_config({"tiers": [{"backend": "redis", "capacity": "1GiB", "uri": "redis://x"}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.timeout: expected float"):
        parse_config({"tiers": [{"backend": "redis", "capacity": "1GiB", "timeout": "1s"}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url: missing \(required by backend"):
        parse_config({"tiers": [{"backend": "redis", "capacity": "1GiB"}]})
    with pytest.raises(ValueError, match=r"cannot use url 'http://u:\*\*\*@host'"):
        RedisBackend("http://u:hunter2@host", 1 << 20)


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
@pytest.mark.parametrize("segment_bytes", [100, 64 << 10, 1 << 20])
def test_values_sent_from_segments_are_whole(
    valkey_server: ValkeyServer, cluster_server: ValkeyServer, cluster: bool, segment_bytes: int
) -> None:
    """Large segments go to the socket as they are (standalone), small ones are joined:
    either way the server holds payload then trailer, and loads give the payload back."""
    server = cluster_server if cluster else valkey_server
    prefix = fresh_prefix()
    backend = RedisBackend(server.url, 1 << 30, cluster=cluster, key_prefix=prefix)
    payloads = [make_payload(i, 3 * segment_bytes) for i in range(4)]
    segmented = [
        [memoryview(p)[j * segment_bytes : (j + 1) * segment_bytes] for j in range(3)]
        for p in payloads
    ]
    keys = [make_key(i) for i in range(4)]
    assert backend.dump(keys, segmented).wait() == [True] * 4
    raw = (
        redis_client.RedisCluster.from_url(server.url)
        if cluster
        else redis_client.Redis.from_url(server.url)
    )
    for index, payload in enumerate(payloads):
        value = raw.get(raw_name(prefix, index))
        assert value is not None and value[:-TRAILER_BYTES] == payload
    buffers = [make_buffer(3 * segment_bytes) for _ in range(4)]
    assert backend.load(keys, views(buffers)).wait() == [True] * 4
    assert buffers == payloads
    raw.close()
    backend.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
def test_a_key_of_another_type_is_a_miss_and_the_rest_of_the_batch_loads(
    valkey_server: ValkeyServer, cluster_server: ValkeyServer, cluster: bool
) -> None:
    """The standalone server's replies are read straight off the socket: an error reply
    in the middle of a pipeline must leave the connection in step for the next ones."""
    server = cluster_server if cluster else valkey_server
    prefix = fresh_prefix()
    backend = RedisBackend(server.url, 1 << 30, cluster=cluster, key_prefix=prefix)
    size = 200 << 10  # Read in several pieces from the socket.
    keys = [make_key(i) for i in range(4)]
    assert backend.dump(keys, views([make_payload(i, size) for i in range(4)])).wait() == [True] * 4
    raw = (
        redis_client.RedisCluster.from_url(server.url)
        if cluster
        else redis_client.Redis.from_url(server.url)
    )
    raw.delete(raw_name(prefix, 1))
    raw.rpush(raw_name(prefix, 1), b"not a block")  # GET answers WRONGTYPE.
    raw.delete(raw_name(prefix, 2))  # GET answers nil.
    for _ in range(2):  # The connection goes back to the pool in step, and is reused.
        buffers = [make_buffer(size) for _ in range(4)]
        loaded = backend.load(keys, views(buffers)).wait()
        assert loaded == [True, False, False, True]
        assert [buffers[0], buffers[3]] == [make_payload(0, size), make_payload(3, size)]
    assert backend.corrupt_blocks == 0
    raw.close()
    backend.close()


def test_unix_socket_url_moves_values_without_copies(valkey_server: ValkeyServer) -> None:
    """Large values go out from, and come back into, the caller's buffers over a Unix
    socket as over TCP."""
    prefix = fresh_prefix()
    backend = RedisBackend(valkey_server.unix_url, 1 << 30, key_prefix=prefix)
    size = 3 << 16
    payloads = [make_payload(i, size) for i in range(3)]
    keys = [make_key(i) for i in range(3)]
    pages = [[memoryview(p)[j << 16 : (j + 1) << 16] for j in range(3)] for p in payloads]
    assert backend.dump(keys, pages).wait() == [True] * 3
    buffers = [make_buffer(size) for _ in range(3)]
    assert backend.load(keys, views(buffers)).wait() == [True] * 3
    assert buffers == payloads
    raw = redis_client.Redis.from_url(valkey_server.url)
    assert raw.strlen(raw_name(prefix, 0)) == size + TRAILER_BYTES
    raw.close()
    backend.close()
