"""disagg-router: OpenAI-compatible push-mode prefill/decode router for vLLM."""

__version__ = "0.1.0"
