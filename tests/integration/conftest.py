"""Fixtures of the integration tests: the tiny model, built once per session, offline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm.testing.model import TINY, build_model


@pytest.fixture(scope="session")
def tiny_model(models_root: Path) -> Iterator[str]:
    """The tiny Llama model directory; Hugging Face libraries stay offline while in use."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield str(build_model(TINY, models_root))
