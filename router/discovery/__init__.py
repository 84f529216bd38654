"""Where a pool's instances come from: static lists, DNS names, the Kubernetes API.

A *source* (:mod:`.source`) yields updates forever: ``Found`` with the complete current set of
instances, or ``Failed`` when it could not tell. A :class:`.watcher.PoolDiscovery` consumes one
source per pool, keeps the last known set across failures (and across empty answers), records
metrics and status for ``/ready``, and hands every changed set to the pool's membership update.
Sources: :class:`.static.StaticSource`, :class:`.dns.DnsSource`,
:class:`.kubernetes.KubernetesSource`; :func:`.factory.make_source` picks one from the config.
"""
