"""Benchmarks for disagg-router: load generator, router overhead, transfer efficiency, scenarios.

Entry point: ``disagg-router bench ...`` dispatches to :mod:`router.bench.cli`.
"""
