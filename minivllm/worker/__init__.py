"""The device's world: the worker (model and KV pool), the model runner and its input batch."""
