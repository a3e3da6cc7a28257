"""Benchmarks: the shared workloads, the side-by-side harness, and the tour."""
