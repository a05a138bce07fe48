"""``async_save`` on a real vLLM engine: blocks written from the KV pages in the background.

A ``posix`` tier whose writes start 0.5 s late (``slow-posix``) keeps writes in flight
while vLLM, with room for only a few requests' KV, finishes requests and hands their
blocks to the next ones. A fresh engine then loads every stored block: its outputs are
token-identical to a run without ucm only if no block was reused before its write. The
negative control turns off the holding of blocks and shows that the stored KV goes bad.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ucm.testing.engine import EngineSpec, Phase, run_engine
from ucm.testing.model import TINY, make_prompt_token_ids

pytestmark = pytest.mark.engine

BLOCK_SIZE = 32
PROMPTS = [make_prompt_token_ids(200, seed=500 + i, vocab_size=TINY.vocab_size) for i in range(16)]
LOADED = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS]
KV_CACHE_BYTES = 2 << 20  # 64 blocks of 32 KiB: about eight requests at a time.


def transfer(store: Path, backend: str, async_save: bool) -> dict[str, Any]:
    tier = {"backend": backend, "path": str(store), "capacity": "64MiB"}
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": [tier], "async_save": async_save},
    }


def write_then_read(tiny_model: str, tmp_path: Path, imports: list[str]) -> list[list[int]]:
    """Save the prompts in one batch through ``slow-posix``; return a fresh engine's
    outputs for them, loaded from the store."""
    store = tmp_path / "store"
    writer = EngineSpec(
        tiny_model,
        [Phase(PROMPTS, max_tokens=4, batch=True)],  # Short lives: blocks reused soon.
        BLOCK_SIZE,
        transfer(store, "slow-posix", async_save=True),
        max_model_len=512,
        kv_cache_bytes=KV_CACHE_BYTES,
        imports=["tests.integration.slow_posix", *imports],
    )
    run_engine(writer, tmp_path / "writer")
    assert "pages read and written in place" in (tmp_path / "writer" / "engine.log").read_text()
    reader = EngineSpec(
        tiny_model,
        [Phase(PROMPTS, max_tokens=40, reset_before_each=True)],
        BLOCK_SIZE,
        transfer(store, "posix", async_save=False),
    )
    result = run_engine(reader, tmp_path / "reader")[0]
    assert result.cached_tokens == LOADED  # Every stored block was found and loaded.
    return result.outputs


@pytest.fixture(scope="module")
def reference(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    spec = EngineSpec(tiny_model, [Phase(PROMPTS, max_tokens=40)], BLOCK_SIZE)
    return run_engine(spec, tmp_path_factory.mktemp("reference"))[0].outputs


def test_blocks_written_from_the_pages_are_exact(
    tiny_model: str, reference: list[list[int]], tmp_path: Path
) -> None:
    assert write_then_read(tiny_model, tmp_path, imports=[]) == reference


def test_negative_control_blocks_reused_before_their_write(
    tiny_model: str, reference: list[list[int]], tmp_path: Path
) -> None:
    outputs = write_then_read(tiny_model, tmp_path, ["tests.integration.no_block_holding"])
    assert outputs != reference, "blocks reused under their writes went unnoticed"
