"""DNS discovery: every address record of a name is an instance (a Kubernetes headless Service).

Each ``interval`` the source resolves ``name``: A and AAAA records (with the configured port), or
with ``srv`` the SRV records (each target's addresses, with the SRV port). A name that does not
exist or has no records yields an empty set (the consumer decides what that means); a resolver
failure (timeout, refused, server failure) yields :class:`Failed`. Resolution uses dnspython's
async resolver: the system configuration (``/etc/resolv.conf``, search domains included) or the
configured ``nameservers``/``nameserver_port``. Instance labels are ``address:port``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from disagg_router.router.config import DnsDiscovery, InstanceConfig
from disagg_router.router.discovery.source import Failed, Update, base_url, found

_EMPTY = (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer)


class DnsSource:
    kind = "dns"

    def __init__(self, config: DnsDiscovery) -> None:
        self.config = config
        self._resolver = dns.asyncresolver.Resolver(configure=not config.nameservers)
        if config.nameservers:
            self._resolver.nameservers = list(config.nameservers)
            self._resolver.port = config.nameserver_port
        self._resolver.timeout = config.timeout
        self._resolver.lifetime = config.timeout

    async def updates(self) -> AsyncGenerator[Update, None]:
        """One resolution now, then one every ``interval`` seconds, forever."""
        while True:
            yield await self.resolve_once()
            await asyncio.sleep(self.config.interval)

    async def resolve_once(self) -> Update:
        """The current set, or :class:`Failed` naming the resolver error."""
        try:
            if self.config.srv:
                return found(await self._from_srv())
            assert self.config.port is not None  # config: port unless srv
            return found(await self._instances(self.config.name, self.config.port))
        except dns.exception.DNSException as exc:
            return Failed(f"resolving {self.config.name}: {exc.__class__.__name__}: {exc}")

    async def _from_srv(self) -> list[InstanceConfig]:
        try:
            answer = await self._resolver.resolve(self.config.name, "SRV", search=True)
        except _EMPTY:
            return []
        targets = sorted({(rr.target.to_text(), int(rr.port)) for rr in answer})
        groups = await asyncio.gather(*(self._instances(t, p) for t, p in targets))
        return [instance for group in groups for instance in group]

    async def _instances(self, name: str, port: int) -> list[InstanceConfig]:
        addresses = await asyncio.gather(self._addresses(name, "A"), self._addresses(name, "AAAA"))
        scheme, key = self.config.scheme, self.config.api_key
        urls = [base_url(scheme, a, port) for group in addresses for a in group]
        return [InstanceConfig(url=u, name=u.split("://", 1)[1], api_key=key) for u in urls]

    async def _addresses(self, name: str, rdtype: str) -> list[str]:
        try:
            answer = await self._resolver.resolve(name, rdtype, search=True)
        except _EMPTY:
            return []
        return sorted(rr.to_text() for rr in answer)
