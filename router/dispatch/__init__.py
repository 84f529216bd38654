"""One client request across its attempts: which route it takes, the pair it goes to, both legs
of each attempt up to the commit point (D's first token), the relay after it, and the bodies
each leg gets."""
