"""ucm's vLLM V1 KV connector (``kv_connector="UCMConnector"``)."""
