"""The accelerator path's ordering of copies, checked on a real engine on the CPU.

Through staging (``in_place: false``, as on a GPU) the worker issues its page gathers
and scatters on a copy stream and orders them with events. Here they run on a
:class:`LaggingStream`, which runs each copy only when an event forces it, as late as a
GPU copy stream could: outputs stay token-identical to a run without ucm, with every
expected hit, only if every wait is in its place. The negative controls break one wait
each and show that the comparison then fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.workload import documents_workload
from ucm.testing.engine import EngineSpec, Phase, PhaseResult, run_engine

pytestmark = pytest.mark.engine

WORKLOAD = documents_workload()
BLOCK_SIZE = 32


def transfer(store: Path, dram: bool, async_load: bool = False) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"backend": "dram", "capacity": "64MiB"}] if dram else []
    tiers.append({"backend": "posix", "path": str(store), "capacity": "256MiB"})
    settings = {"tiers": tiers, "in_place": False, "async_load": async_load}
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": settings,
    }


def run_lagging(
    model: str, workdir: Path, phases: list[Phase], settings: dict[str, Any], **env: str
) -> tuple[list[PhaseResult], int]:
    """Run an engine whose copies lag; return its results and how many copies ran late."""
    spec = EngineSpec(
        model, phases, BLOCK_SIZE, settings, env=env, imports=["tests.integration.lagging_copies"]
    )
    results = run_engine(spec, workdir)
    log = (workdir / "engine.log").read_text()
    assert "copied through staging" in log
    found = re.search(r"ucm test: (\d+) copies ran late", log)
    assert found is not None
    return results, int(found.group(1))


def warm() -> Phase:
    return Phase(WORKLOAD.warm, reset_before_each=True)


@pytest.mark.parametrize("async_load", [False, True])
def test_copies_that_lag_are_waited_for(
    async_load: bool, tiny_model: str, reference: Callable[[int], list[list[int]]], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    settings = transfer(store, dram=True, async_load=async_load)
    # The same engine after vLLM's own cache is emptied (hits from dram), then a fresh
    # engine (hits from posix, in the background with async_load).
    same, lagged = run_lagging(
        tiny_model, tmp_path / "writer", [Phase(WORKLOAD.cold), warm()], settings
    )
    assert lagged > 0
    fresh, lagged = run_lagging(tiny_model, tmp_path / "reader", [warm()], settings)
    assert lagged > 0
    everything = [(len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE for prompt in WORKLOAD.warm]
    for result, expected in [
        (same[1], WORKLOAD.expected_loaded(BLOCK_SIZE)),
        (fresh[0], everything),  # The writer's warm phase stored the new questions too.
    ]:
        assert result.outputs == reference(BLOCK_SIZE)
        assert result.cached_tokens == expected and all(expected)


def test_negative_control_forward_pass_runs_before_its_loads(
    tiny_model: str, reference: Callable[[int], list[list[int]]], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    run_lagging(tiny_model, tmp_path / "writer", [Phase(WORKLOAD.cold)], transfer(store, False))
    settings = transfer(store, dram=False)
    (broken,), lagged = run_lagging(
        tiny_model, tmp_path / "reader", [warm()], settings, UCM_TEST_COMPUTE_WAITS="0"
    )
    assert lagged > 0  # The loads' copies ran, but later than the forward pass.
    assert broken.cached_tokens == WORKLOAD.expected_loaded(BLOCK_SIZE)  # Loads were planned.
    assert broken.outputs != reference(BLOCK_SIZE), "pages read before their loads went unnoticed"


def test_negative_control_writes_before_their_copies(
    tiny_model: str, reference: Callable[[int], list[list[int]]], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    settings = transfer(store, dram=False)  # The reader loads what posix holds.
    env = {"UCM_TEST_COMPUTE_WAITS": "0", "UCM_TEST_WRITES_WAIT": "0"}
    run_lagging(tiny_model, tmp_path / "writer", [Phase(WORKLOAD.cold)], settings, **env)
    (reader,), _ = run_lagging(tiny_model, tmp_path / "reader", [warm()], settings)
    assert reader.cached_tokens == WORKLOAD.expected_loaded(BLOCK_SIZE)
    assert reader.outputs != reference(BLOCK_SIZE), (
        "rows written before their copies went unnoticed"
    )
