"""One client request across its attempts: which route it takes, the pair it goes to, both legs
of each attempt up to the commit point (D's first token) and the relay after it. Builds on
:mod:`disagg_router.router.instances`, :mod:`disagg_router.router.routing` and
:mod:`disagg_router.router.upstream`; never imports health."""
