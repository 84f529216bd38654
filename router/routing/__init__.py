"""Where a request can go: the routing table (model -> P and D pools), the pools, the policies
that pick one instance, what they read from a prompt, and each instance's runtime state."""
