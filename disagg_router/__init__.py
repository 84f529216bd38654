"""disagg-router: push-mode disaggregated prefill/decode serving for vLLM.

The distribution's one top-level package, so its names cannot collide with other projects':

- :mod:`disagg_router.router`: the OpenAI-compatible router (its public API is what that package
  exports; the ``disagg-router`` command runs it);
- :mod:`disagg_router.connector`: the vLLM KV connector, loaded by vLLM with
  ``"kv_connector_module_path": "disagg_router.connector"``.

Importing this package imports neither.
"""
