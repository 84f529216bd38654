"""The client's side of a request: the ASGI app, its endpoints and everything checked before any
upstream traffic (header and body bounds, request ids, validation, disconnects).

Only the router's top level (:mod:`disagg_router.router.server`, the public names in :mod:`router`)
imports this package; nothing below it does (``tests/unit/router/test_router_layout.py``).
"""
