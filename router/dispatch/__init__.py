"""One client request across its attempts: which route it takes, the pair it goes to, both legs
of each attempt up to the commit point (D's first token) and the relay after it. Builds on
:mod:`router.instances`, :mod:`router.routing` and :mod:`router.upstream`; never imports
health."""
