"""Fixtures of the integration tests: the tiny model (built once per session, offline)
and the reference outputs of the standard workload without any connector."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.workload import documents_workload
from ucm.testing.engine import EngineSpec, Phase, run_engine
from ucm.testing.model import TINY, TINY_MLA, ModelSpec, build_model

WORKLOAD = documents_workload()


def offline(spec: ModelSpec, models_root: Path) -> Iterator[str]:
    """Build a model and keep Hugging Face libraries offline while it is in use."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield str(build_model(spec, models_root))


@pytest.fixture(scope="session")
def tiny_model(models_root: Path) -> Iterator[str]:
    """The tiny Llama model directory."""
    yield from offline(TINY, models_root)


@pytest.fixture(scope="session")
def mla_model(models_root: Path) -> Iterator[str]:
    """A tiny DeepSeek-V2-style model with multi-head latent attention."""
    yield from offline(TINY_MLA, models_root)


@pytest.fixture(scope="session")
def reference(
    tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int], list[list[int]]]:
    """Outputs of the warm prompts without any connector, per block size."""
    cache: dict[int, list[list[int]]] = {}

    def outputs(block_size: int) -> list[list[int]]:
        if block_size not in cache:
            spec = EngineSpec(tiny_model, [Phase(WORKLOAD.warm)], block_size=block_size)
            workdir = tmp_path_factory.mktemp(f"reference-{block_size}")
            cache[block_size] = run_engine(spec, workdir)[0].outputs
        return cache[block_size]

    return outputs
