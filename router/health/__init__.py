"""Whether an instance may take a leg: active probes and identity probing, the breaker fed by
real legs, admission limits, and the load signals scraped from the instances."""
