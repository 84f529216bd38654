"""Pool membership of discovered pools: DNS names or the Kubernetes API (a static pool's
instances are its configured list, kept by the routing table and its reloads, not by a source).

A *source* (:mod:`.source`) yields updates forever: ``Found`` with the complete current set of
instances, or ``Failed`` when it could not tell. A :class:`.watcher.PoolDiscovery` consumes one
source per pool, keeps the last known set across failures (and across empty answers), records
metrics and status for ``/ready``, and hands every changed set to the pool's membership update.
Sources: :class:`.dns.DnsSource`, :class:`.kubernetes.KubernetesSource`;
:func:`.factory.make_source` picks one from the config.
"""
