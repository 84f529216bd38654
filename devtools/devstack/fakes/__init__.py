"""Fakes of the router's upstreams (vLLM) for tests and benchmarks.

Import them from ``devstack.fake_vllm`` (the stable path).
"""
