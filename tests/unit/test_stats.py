"""ucm's statistics: aggregation over workers and steps, the log summary, the metered
backend wrapper and the Prometheus export (end to end in test_pd_serving.py)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ucm.integration.vllm.metered import MeteredBackend
from ucm.integration.vllm.stats import MAX_SAMPLES, StatsRecorder, UCMPromMetrics, UCMStats
from ucm.store.dram import DramBackend
from ucm.testing.conformance import make_buffer, make_key, make_payload, views


def test_stats_add_counters_keep_the_larger_gauge_and_bound_samples() -> None:
    one = StatsRecorder()
    one.count("hit_tokens", 64)
    one.count("query_tokens", 128)
    one.count("load_bytes|0:dram", 1000)
    one.gauge("used_bytes|1:posix", 10)
    one.sample("load_seconds|0:dram", 0.5)
    two = StatsRecorder()
    two.count("hit_tokens", 32)
    two.count("load_bytes|0:dram", 500)
    two.gauge("used_bytes|1:posix", 30)
    for _ in range(MAX_SAMPLES):
        two.sample("load_seconds|0:dram", 0.001)
    first, second = one.take(), two.take()
    assert first is not None and second is not None
    total = first.aggregate(second)
    assert total.data["counters"] == {
        "hit_tokens": 96,
        "query_tokens": 128,
        "load_bytes|0:dram": 1500,
    }
    assert total.data["gauges"] == {"used_bytes|1:posix": 30}
    assert len(total.data["samples"]["load_seconds|0:dram"]) == MAX_SAMPLES
    assert one.take() is None  # Taken: the next interval starts empty.
    summary = total.reduce()
    assert summary["ucm_hit_tokens"] == 96
    assert summary["ucm_hit_rate"] == 0.75
    assert summary["ucm_load_GB"] == round(1500 / 1e9, 4)


def test_stats_survive_their_payload_round_trip() -> None:
    recorder = StatsRecorder()
    recorder.count("lookups")
    stats = recorder.take()
    assert stats is not None
    assert UCMStats(stats.to_dict()).reduce() == stats.reduce()
    assert UCMStats().is_empty()


def test_metered_backend_counts_what_moved() -> None:
    recorder = StatsRecorder()
    backend = MeteredBackend(DramBackend(1 << 20), "0:dram", recorder)
    keys = [make_key(0), make_key(1)]
    assert backend.dump(keys[:1], views([make_payload(0, 100)])).wait() == [True]
    assert backend.dump([make_key(2)], views([make_payload(2, 2 << 20)])).wait() == [False]
    assert backend.load(keys, views([make_buffer(100), make_buffer(100)])).wait() == [True, False]
    stats = recorder.take()
    assert stats is not None
    counters = stats.data["counters"]
    assert counters["save_blocks|0:dram"] == 1
    assert counters["save_bytes|0:dram"] == 100
    assert counters["load_blocks|0:dram"] == 1
    assert counters["load_bytes|0:dram"] == 100
    assert counters["errors|write_dropped"] == 1
    assert len(stats.data["samples"]["load_seconds|0:dram"]) == 1
    assert stats.data["gauges"]["used_bytes|0:dram"] == 100


def test_prometheus_metrics_export_the_stats() -> None:
    registry = CollectorRegistry()

    def bound(base: Any) -> Any:
        class Bound(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, multiprocess_mode: str = "", **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    metrics = UCMPromMetrics(
        vllm_config=_NoTransfer(), metric_types=types, labelnames=["model_name", "engine"],
        per_engine_labelvalues={0: ["m", "0"]},
    )  # fmt: skip
    recorder = StatsRecorder()
    recorder.count("hit_tokens", 64)
    recorder.count("query_tokens", 256)
    recorder.count("load_bytes|1:posix", 4096)
    recorder.count("errors|load_failed", 2)
    recorder.gauge("used_bytes|1:posix", 8192)
    recorder.sample("load_seconds|1:posix", 0.002)
    stats = recorder.take()
    assert stats is not None
    metrics.observe(stats.to_dict(), engine_idx=0)
    value = registry.get_sample_value
    assert value("ucm:hit_tokens_total", {"model_name": "m", "engine": "0"}) == 64
    assert value("ucm:hit_rate", {"model_name": "m", "engine": "0"}) == 0.25
    tier = {"model_name": "m", "engine": "0", "tier": "1:posix"}
    assert value("ucm:tier_load_bytes_total", tier) == 4096
    assert value("ucm:store_used_bytes", tier) == 8192
    assert value("ucm:load_seconds_count", tier) == 1
    assert value("ucm:errors_total", {"model_name": "m", "engine": "0", "kind": "load_failed"}) == 2


class _NoTransfer:
    kv_transfer_config = None
