"""Our NIXL push KV connector for vLLM (loaded with ``kv_connector_module_path``)."""
