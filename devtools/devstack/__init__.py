"""Development stack: tiny model, real vLLM instances, connectors, whole P/D stacks, demo."""
