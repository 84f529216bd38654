"""Request arrival schedules: Poisson (burstiness 1) or gamma inter-arrival times.

Same process as ``vllm bench serve``: inter-arrival gaps drawn from Gamma(shape=burstiness,
scale=1/(rate*burstiness)), cumulated, then rescaled so the last arrival lands exactly at
``n / rate`` (which removes the 1-2 % run-to-run throughput jitter of the raw sum).
"""

from __future__ import annotations

import math
import random


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Return send offsets in seconds from the start of the run, one per request.

    ``request_rate`` may be ``math.inf`` (all requests at t=0). Pure function; callers sleep.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    gaps: list[float]
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * num_requests
    else:
        scale = 1.0 / (request_rate * burstiness)
        gaps = [rng.gammavariate(burstiness, scale) for _ in range(num_requests)]
    offsets: list[float] = []
    total = 0.0
    for gap in gaps:
        total += gap
        offsets.append(total)
    if offsets[-1] > 0:
        factor = (num_requests / request_rate) / offsets[-1]
        offsets = [o * factor for o in offsets]
    return offsets
