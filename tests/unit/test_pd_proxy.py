"""Unit tests of the prefill/decode proxy's pieces (the whole runs in
tests/integration/test_pd_serving.py)."""

from __future__ import annotations

import pytest

from ucm.serving.pd_proxy import Pool, prefill_request


def test_pool_picks_the_least_loaded_instance_and_takes_turns_on_ties() -> None:
    pool = Pool(["http://a/", "http://b", "http://c"])
    assert [pool.pick() for _ in range(3)] == ["http://a", "http://b", "http://c"]
    pool.outstanding["http://a"] = 2
    pool.outstanding["http://b"] = 1
    assert pool.pick() == "http://c"
    pool.outstanding["http://c"] = 3
    assert pool.pick() == "http://b"


def test_pool_needs_an_instance() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Pool([])


def test_prefill_request_asks_for_one_token_without_streaming() -> None:
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 100,
        "max_completion_tokens": 100,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    prefill = prefill_request(body)
    assert prefill == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "min_tokens": 0,
        "temperature": 0,
    }
    assert body["max_tokens"] == 100  # The client's request is left as it was.
