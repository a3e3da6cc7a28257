"""The scheduler's world (no tensors): requests, the KV-cache manager and its prefix cache, the
scheduler and the plain-data step it sends to the workers."""
