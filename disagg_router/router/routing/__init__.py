"""Where a request can go: the routing table (model -> P and D pools), the pools, the policies
that pick one instance (one per module, :mod:`disagg_router.router.routing.policies`), what they
read from a prompt, and the KV index they may consult. Builds on
:mod:`disagg_router.router.instances`; never imports health or dispatch."""
