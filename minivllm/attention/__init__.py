"""Attention over the paged KV pool: the backend contract and registry, and the backends."""
