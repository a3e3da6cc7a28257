"""Sampling: the parameters of a request and the batched sampler."""
