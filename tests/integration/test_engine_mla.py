"""ucm on a model with multi-head latent attention (MLA, DeepSeek-V2 style) on real vLLM.

On the CPU backend vLLM runs MLA without prefix caching or chunked prefill, so ucm
must not load there (see the test). Placement of MLA blocks at TP>1 (one rank writes,
all load) is unit-tested in tests/unit/test_model_info.py; no MLA engine here can
reuse a prefix to run it end to end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import WORKLOAD
from ucm.testing.engine import EngineSpec, Phase, run_engine

pytestmark = pytest.mark.engine

# vLLM prefers its AMX MLA kernels where the CPU has AMX tiles, and they need bf16
# weights; the reference CPU kernels run float32 on any x86 or Arm CPU.
BACKEND = "CPU_MLA"
BLOCK = 16  # The block size vLLM's CPU MLA backend requires (it overrides others).


def ucm(store: Path) -> dict[str, Any]:
    tiers = [
        {"backend": "dram", "capacity": "64MiB"},
        {"backend": "posix", "path": str(store), "capacity": "256MiB"},
    ]
    return {
        "kv_connector": "UCMConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": tiers},
    }


def reference_of(model: str, workdir: Path) -> list[list[int]]:
    spec = EngineSpec(model, [Phase(WORKLOAD.warm)], BLOCK, attention_backend=BACKEND)
    return run_engine(spec, workdir)[0].outputs


def test_mla_on_cpu_is_served_exactly_without_ucm_loads(mla_model: str, tmp_path: Path) -> None:
    """vLLM turns prefix caching and chunked prefill off for MLA on CPU: its MLA kernels
    never compute a prompt on top of cached KV there, and a prompt computed on KV that
    ucm loaded came out different (checked while writing this test: one of four). ucm
    must then stay out of the way: no loads, no saves, exact outputs, a clear warning."""
    reference = reference_of(mla_model, tmp_path / "reference")
    store = tmp_path / "store"
    phases = [Phase(WORKLOAD.cold), Phase(WORKLOAD.warm, reset_before_each=True)]
    spec = EngineSpec(mla_model, phases, BLOCK, ucm(store), attention_backend=BACKEND)
    warm = run_engine(spec, tmp_path / "engine")[1]
    assert warm.outputs == reference
    assert warm.cached_tokens == [0] * len(WORKLOAD.warm)
    assert not list(store.rglob("*.blk"))
    log = (tmp_path / "engine" / "engine.log").read_text()
    assert "ucm neither loads nor saves blocks here" in log
