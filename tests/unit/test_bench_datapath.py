"""The data-path micro-benchmark runs end to end on small sizes and reports every figure."""

from __future__ import annotations

import os
from pathlib import Path

from ucm.bench import datapath


def test_datapath_benchmark_reports_rates_ratios_and_lookup(tmp_path: Path) -> None:
    results = datapath.run(
        tmp_path, block_bytes=64 << 10, count=8, disk_bytes=8 << 20, index_blocks=2000
    )
    rates = {rate["name"]: rate["gb_per_s"] for rate in results["rates"]}  # type: ignore[union-attr, index]
    assert {"memory copy", "dram save", "posix load", "gather", "scatter"} <= set(rates)
    assert {"dram load into pages, 4 threads", "posix save from pages"} <= set(rates)
    assert {"block checksum", "posix load, verify off"} <= set(rates)
    assert {"disk read (O_DIRECT)", "posix load (direct_io)"} <= set(rates)
    assert all(value > 0 for value in rates.values())
    skipped = results["skipped"]
    assert not (skipped and os.environ.get("CI")), skipped  # CI's set-up installs both.
    if not skipped:
        assert {"redis save", "redis raw get", "mooncake load", "mooncake raw put"} <= set(rates)
        assert len(results["ratios"]) == 16  # type: ignore[arg-type]
    assert set(results["lookup"]) == {  # type: ignore[arg-type]
        "key hashing (us)",
        "dram prefix lookup (us)",
        "posix, in-memory index prefix lookup (us)",
        "posix, stat prefix lookup (us)",
    }
    report = datapath.markdown(results)
    assert "| dram save |" in report and "prefix lookup" in report
    assert not list(tmp_path.rglob("*.blk")), "scratch stores are removed"
