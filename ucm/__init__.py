"""ucm (Unified Cache Management): a persistent, shared KV-cache tier for vLLM.

Select it in vLLM with ``kv_transfer_config={"kv_connector": "UCMConnector", ...}``;
the storage layer (:mod:`ucm.store`) imports without vLLM.
"""

__version__ = "0.1.0"
