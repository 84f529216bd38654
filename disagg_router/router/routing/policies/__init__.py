"""Load-balancing policies: pick one instance of a pool for one dispatch, one policy per module.

Who calls them: :class:`disagg_router.router.routing.pools.Pool` builds its policy with
:func:`disagg_router.router.routing.policies.factory.make_policy` and calls ``choose`` with the
currently usable candidates (never empty, in pool order) and the request being routed. A policy must
be cheap, must not block, and must not mutate the backends it is given. Each says which of the
pool's settings it reads (``settings``: a change rebuilds it) and which signals it needs beyond the
router's own counts (``signals``: ``"load"``, vLLM's gauges scraped for its instances;
``"kv_events"``, the model's KV index).

- ``round_robin`` (:mod:`.round_robin`): cycles; for identical instances and uniform requests.
- ``least_in_flight`` (:mod:`.least_in_flight`): fewest legs in flight from this router.
- ``power_of_two`` (:mod:`.power_of_two`): two random candidates, the less loaded wins.
- ``prefix_affinity`` (:mod:`.prefix_affinity`) and ``session_affinity``
  (:mod:`.session_affinity`): bounded rendezvous hashing (:mod:`.affinity`) of the prompt's
  leading characters or of a session key.
- ``kv_aware`` (:mod:`.kv_aware`): by the prompt tokens each instance's KV cache holds.

Adding a policy: a module here with its class, and its entry in :mod:`.factory` (and its name in
``disagg_router.router.config.PolicyName``, which the config file is checked against; a test keeps
the two in step).
"""
