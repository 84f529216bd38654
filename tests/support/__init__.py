"""Helpers shared by the test suites: the one wait helper, SSE parsing, process stand-ins."""
