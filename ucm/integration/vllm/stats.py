"""ucm's statistics for vLLM: per-interval stats for its log line and Prometheus metrics.

Both halves of the connector record what they do in a :class:`StatsRecorder`; vLLM
collects it every step (``get_kv_connector_stats``), sums it over workers and over the
logging interval (:class:`UCMStats`), prints :meth:`UCMStats.reduce` in its periodic
"KV Transfer metrics" line, and hands each step's data to :class:`UCMPromMetrics`,
which exports it on ``vllm serve``'s ``/metrics`` under the ``ucm:`` prefix.

A stats payload is a plain dict (it travels between processes)::

    {"counters": {"hit_tokens": 320, "load_bytes|dram": 1048576, ...},
     "gauges": {"used_bytes|posix": 4096, ...},
     "samples": {"load_seconds|posix": [0.0012, ...], ...}}

Names ending in ``|<tier>`` are per tier (``<index>:<backend>``, e.g. ``1:posix``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ucm.config import TierConfig

MAX_SAMPLES = 1000
"""Latency samples kept per name and interval (the oldest are dropped beyond it)."""
LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
"""Histogram buckets of transfer latencies, in seconds."""
ERROR_KINDS = ("load_failed", "write_dropped", "corrupt")
"""Kinds of errors counted under ``errors|<kind>``."""

_COUNTERS: dict[str, str] = {
    "lookups": "Requests whose prompt ucm looked up",
    "query_tokens": "Prompt tokens ucm could have served (full blocks beyond local hits)",
    "hit_tokens": "Prompt tokens ucm served instead of vLLM computing them",
}
_TIER_COUNTERS: dict[str, str] = {
    "hit_tokens": "Prompt tokens served, by the tier they came from",
    "load_blocks": "Blocks loaded from the tier",
    "load_bytes": "Bytes loaded from the tier",
    "save_blocks": "Blocks written to the tier",
    "save_bytes": "Bytes written to the tier",
}
_TIER_HISTOGRAMS: dict[str, str] = {
    "load_seconds": "Seconds per batch of blocks read from the tier",
    "save_seconds": "Seconds per batch of blocks written to the tier",
}


def tier_name(index: int, tier: TierConfig) -> str:
    """Return a tier's name in the stats and metric labels: ``<index>:<backend>``."""
    return f"{index}:{tier.backend}"


def _empty() -> dict[str, Any]:
    return {"counters": {}, "gauges": {}, "samples": {}}


@dataclass
class UCMStats(KVConnectorStats):
    """Counters, gauges and latency samples of one interval, summed over workers."""

    data: dict[str, Any] = field(default_factory=_empty)

    def reset(self) -> None:
        """Forget everything recorded."""
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters and samples to these; gauges keep the larger value.

        Args:
            other: Stats of another worker, another half, or a later step.

        Returns:
            These stats, updated.
        """
        theirs = other.data
        ours = self.data
        for name, value in theirs.get("counters", {}).items():
            ours["counters"][name] = ours["counters"].get(name, 0) + value
        for name, value in theirs.get("gauges", {}).items():
            ours["gauges"][name] = max(ours["gauges"].get(name, value), value)
        for name, values in theirs.get("samples", {}).items():
            merged = ours["samples"].setdefault(name, [])
            merged.extend(values)
            del merged[:-MAX_SAMPLES]
        return self

    def reduce(self) -> dict[str, int | float]:
        """Summarize the interval for vLLM's log line.

        Returns:
            Hit rate, tokens served, and per direction the blocks, GB and GB/s moved.
        """
        counters = self.data["counters"]
        queried = counters.get("query_tokens", 0)
        summary: dict[str, int | float] = {
            "ucm_lookups": counters.get("lookups", 0),
            "ucm_hit_tokens": counters.get("hit_tokens", 0),
            "ucm_hit_rate": round(counters.get("hit_tokens", 0) / queried, 4) if queried else 0.0,
        }
        for direction in ("load", "save"):
            nbytes = _tier_sum(counters, f"{direction}_bytes")
            seconds = sum(
                sum(values)
                for name, values in self.data["samples"].items()
                if name.startswith(f"{direction}_seconds|")
            )
            summary[f"ucm_{direction}_blocks"] = _tier_sum(counters, f"{direction}_blocks")
            summary[f"ucm_{direction}_GB"] = round(nbytes / 1e9, 4)
            summary[f"ucm_{direction}_GBps"] = round(nbytes / 1e9 / seconds, 3) if seconds else 0.0
        summary["ucm_errors"] = _tier_sum(counters, "errors")
        return summary

    def is_empty(self) -> bool:
        """Return whether nothing was recorded."""
        return not any(self.data.get(part) for part in ("counters", "gauges", "samples"))


def _tier_sum(counters: dict[str, float], prefix: str) -> int:
    return int(sum(v for name, v in counters.items() if name.startswith(prefix + "|")))


class StatsRecorder:
    """A thread-safe collector of one connector half's stats until vLLM takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()

    def count(self, name: str, value: float = 1) -> None:
        """Add ``value`` to a counter."""
        if value:
            with self._lock:
                counters = self._data["counters"]
                counters[name] = counters.get(name, 0) + value

    def gauge(self, name: str, value: float) -> None:
        """Set a gauge."""
        with self._lock:
            self._data["gauges"][name] = value

    def sample(self, name: str, seconds: float) -> None:
        """Record one latency sample."""
        with self._lock:
            samples = self._data["samples"].setdefault(name, [])
            samples.append(seconds)
            del samples[:-MAX_SAMPLES]

    def take(self) -> UCMStats | None:
        """Return what was recorded since the last call and start afresh; None if nothing."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = UCMStats(data)
        return None if stats.is_empty() else stats


class UCMPromMetrics(KVConnectorPromMetrics):
    """ucm's Prometheus metrics (``ucm:`` prefix), fed with each step's stats."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """Register the metrics with the classes vLLM hands over (multiprocess-aware).

        Args:
            vllm_config: The engine's configuration.
            metric_types: vLLM's Gauge, Counter and Histogram classes, by base class.
            labelnames: vLLM's label names (model, engine).
            per_engine_labelvalues: vLLM's label values per engine index.
        """
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tier = [*labelnames, "tier"]
        self._counters = {
            name: self._counter_cls(f"ucm:{name}", doc, labelnames=labelnames)
            for name, doc in _COUNTERS.items()
        }
        self._tier_counters = {
            name: self._counter_cls(f"ucm:tier_{name}", doc, labelnames=tier)
            for name, doc in _TIER_COUNTERS.items()
        }
        self._histograms = {
            name: self._histogram_cls(
                f"ucm:{name}", doc, labelnames=tier, buckets=list(LATENCY_BUCKETS)
            )
            for name, doc in _TIER_HISTOGRAMS.items()
        }
        self._errors = self._counter_cls(
            "ucm:errors", "Transfer errors by kind", labelnames=[*labelnames, "kind"]
        )
        self._used = self._gauge_cls(
            "ucm:store_used_bytes",
            "Bytes a tier holds (for shared tiers: as far as this engine knows)",
            labelnames=tier,
            multiprocess_mode="mostrecent",
        )
        self._hit_rate = self._gauge_cls(
            "ucm:hit_rate",
            "Share of the prompt tokens ucm could have served that it served (last step)",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Export one step's stats.

        Args:
            transfer_stats_data: A :class:`UCMStats` payload.
            engine_idx: The engine the stats come from.
        """
        labels = self.per_engine_labelvalues[engine_idx]
        counters = transfer_stats_data.get("counters", {})
        for name, value in counters.items():
            base, _, tier = name.partition("|")
            if not tier and base in self._counters:
                self._counters[base].labels(*labels).inc(value)
            elif base == "errors":
                self._errors.labels(*labels, tier).inc(value)
            elif base in self._tier_counters:
                self._tier_counters[base].labels(*labels, tier).inc(value)
        if counters.get("query_tokens"):
            rate = counters.get("hit_tokens", 0) / counters["query_tokens"]
            self._hit_rate.labels(*labels).set(rate)
        for name, values in transfer_stats_data.get("samples", {}).items():
            base, _, tier = name.partition("|")
            if base in self._histograms:
                histogram = self._histograms[base].labels(*labels, tier)
                for seconds in values:
                    histogram.observe(seconds)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            base, _, tier = name.partition("|")
            if base == "used_bytes":
                self._used.labels(*labels, tier).set(value)
