"""An emulated vLLM engine that a router cannot tell from vLLM in P/D mode, cheap enough to run
tens of them on one machine: a scheduler with a token budget and chunked prefill over a paged KV
cache with prefix caching, LRU eviction and preemption; step and transfer times from a profile;
vLLM's HTTP routes, metric names and KV events.

Modules, in the order a request meets them: :mod:`.fleet` (engines served in one process),
:mod:`.app` (the HTTP routes), :mod:`.tokens` (prompt -> token ids), :mod:`.engine` (the step
loop, KV hand-over between engines), :mod:`.scheduler` (continuous batching), :mod:`.blocks`
(the paged cache and its events), :mod:`.profile` (step and transfer times).
"""

from devstack.emulator.fleet import Fleet, FleetSpec
from devstack.emulator.profile import Profile, load_profile

__all__ = ["Fleet", "FleetSpec", "Profile", "load_profile"]
