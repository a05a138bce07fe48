"""The worker-side data path: vLLM's paged KV tensors as blocks of bytes."""
