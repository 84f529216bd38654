"""Whether an instance may take a leg, found out actively: health checks and identity probes,
the breaker's probes, the load signals scraped from the instances, what ``/ready`` reports.
Builds on :mod:`router.instances` and :mod:`router.routing`; never imports dispatch."""
