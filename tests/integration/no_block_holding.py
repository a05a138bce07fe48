"""Breaks ucm on purpose for a negative control: vLLM may reuse a finished or preempted
request's blocks while ``async_save`` still writes them from the pages.

Imported into an engine process (``EngineSpec.imports``).
"""

from __future__ import annotations

from typing import Any

from ucm.integration.vllm.ucm_connector import UCMConnector

_request_finished = UCMConnector.request_finished


def _never_hold(self: UCMConnector, request: Any, block_ids: list[int]) -> tuple[bool, None]:
    _request_finished(self, request, block_ids)
    return False, None


def _loads_only(self: UCMConnector, finished: set[str]) -> tuple[None, set[str] | None]:
    return None, self._worker_half().take_finished_loads() or None  # vLLM freed the rest.


UCMConnector.request_finished = _never_hold  # type: ignore[method-assign]
UCMConnector.get_finished = _loads_only  # type: ignore[method-assign]
UCMConnector.handle_preemptions = lambda self, metadata: None  # type: ignore[method-assign]
