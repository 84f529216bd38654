"""The bottom layer of the request path: what the router knows of each vLLM instance.

Its runtime state (:mod:`.state`), one state per instance shared by every pool that lists it
(:mod:`.registry`), the admission gate (:mod:`.admission`) and breaker (:mod:`.breaker`) every
leg passes, the load it reports (:mod:`.load`) and what a leg or probe teaches about it
(:mod:`.identity`). It imports only the config, the errors and observability; routing, health
and dispatch all build on it.
"""
