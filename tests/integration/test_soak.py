"""The soak driver, on a short run: exact outputs, real hits, faults found, nothing leaked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ucm.testing.soak import main

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    ("eviction", "async_save"), [("lru", False), ("s3fifo", False), ("lru", True)]
)
def test_short_soak_is_exact_and_leaks_nothing(
    eviction: str, async_save: bool, tmp_path: Path
) -> None:
    extra = ["--async-save"] if async_save else []
    assert main([str(tmp_path), "--requests", "160", "--eviction", eviction, *extra]) == 0
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["requests"] == 160
    assert result["wrong_outputs"] == 0
    assert result["prompt_tokens_cached"] > 0
    assert result["corruptions_injected"] > 0
    assert result["fds_after"] <= result["fds_before"] + 8  # Reader/writer pools may open some.
    assert result["vllm_unfinished_requests"] == 0
    assert result["vllm_requests_held"] == 0  # No finished request still holds blocks.
    assert result["ucm_tracked_requests"] == 0
