"""Whether an instance may take a leg, found out actively: health checks and identity probes,
the breaker's probes, the load signals scraped from the instances, what ``/ready`` reports.
Builds on :mod:`disagg_router.router.instances` and :mod:`disagg_router.router.routing`; never
imports dispatch."""
