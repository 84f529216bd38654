"""The project's tests: unit, integration (real loopback servers), e2e (real vLLM), deploy."""
