"""Fixtures shared by ucm's test suites."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for locally built models, shared by the whole session."""
    return tmp_path_factory.mktemp("models")
