"""Serving with ucm: ``ucm serve`` (vLLM's OpenAI-compatible server, on any vLLM build)
and ``ucm pd-proxy`` (prefill/decode disaggregation through a shared ucm store)."""
