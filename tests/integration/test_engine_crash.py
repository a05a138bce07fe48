"""Engines killed (SIGKILL) at random points while loading and saving, one after the
other on one store; then a fresh engine must serve every prompt exactly from it.

``UCM_ENGINE_CRASH_TRIALS=N`` runs more trials (20 by default).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from ucm.store.posix_fsck import fsck
from ucm.testing.engine import EngineSpec, Phase, run_engine, start_engine
from ucm.testing.model import TINY, make_prompt_token_ids

pytestmark = pytest.mark.engine

TRIALS = int(os.environ.get("UCM_ENGINE_CRASH_TRIALS", "20"))


def test_engines_killed_at_random_points_leave_a_store_that_serves_exactly(
    tiny_model: str, tmp_path: Path
) -> None:
    rng = random.Random(0)
    vocab = TINY.vocab_size
    prompts = [
        make_prompt_token_ids(320, seed=9000 + trial, vocab_size=vocab)
        + make_prompt_token_ids(16, seed=9500 + trial, vocab_size=vocab)
        for trial in range(TRIALS)
    ]
    store = tmp_path / "store"
    tiers = [{"backend": "posix", "path": str(store), "capacity": "256MiB"}]
    transfer = {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": tiers},
    }
    killed = 0
    for trial in range(TRIALS):
        # Each engine loads what the last two saved (if they got that far) and saves anew.
        batch = prompts[max(trial - 2, 0) : trial + 1]
        spec = EngineSpec(tiny_model, [Phase(batch, max_tokens=32)], 32, transfer)
        stored = len(list(store.rglob("*.blk")))
        engine = start_engine(spec, tmp_path / f"engine{trial}")
        deadline = time.monotonic() + 300
        while len(list(store.rglob("*.blk"))) == stored and engine.poll() is None:
            assert time.monotonic() < deadline, f"engine {trial} never saved a block"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # Somewhere in its saves (or after them).
        killed += engine.poll() is None
        engine.kill()
        engine.wait()
    assert killed >= TRIALS // 2, f"only {killed} of {TRIALS} engines were killed in time"
    reference = run_engine(EngineSpec(tiny_model, [Phase(prompts)], 32), tmp_path / "reference")
    reader = EngineSpec(tiny_model, [Phase(prompts)], 32, transfer)
    served = run_engine(reader, tmp_path / "reader")[0]
    assert served.outputs == reference[0].outputs
    assert sum(1 for tokens in served.cached_tokens if tokens > 0) >= TRIALS // 2
    assert not list(store.rglob("*.tmp")), "a killed engine's temporary file was left"
    report = fsck(store)
    assert report.clean, report
