"""What the router tells its operators: Prometheus metrics, the request log line, tracing."""
