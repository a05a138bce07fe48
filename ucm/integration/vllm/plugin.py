"""The ``vllm.general_plugins`` entry point that registers ``UCMConnector`` with vLLM."""

from __future__ import annotations

import contextlib

CONNECTOR_NAME = "UCMConnector"
"""The name users put in ``kv_transfer_config={"kv_connector": ...}``."""


def register() -> None:
    """Register ``UCMConnector`` with vLLM's connector factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # Already registered in this process.
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "ucm.integration.vllm.ucm_connector", "UCMConnector"
        )
