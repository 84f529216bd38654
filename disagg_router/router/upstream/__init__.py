"""Talking to vLLM instances: the one HTTP client, leg calls with their errors translated, the
bodies each leg gets (:mod:`.rewrite`), the SSE reader and the JSON codec. Imports nothing of the
router's request path."""
