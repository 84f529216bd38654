"""Benchmarks for disagg-router: load generator, router overhead, transfer efficiency, scenarios.

Entry point: ``disagg-bench ...`` dispatches to :mod:`bench.cli`.
"""
