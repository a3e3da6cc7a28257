"""The engine: requests in, steps through the scheduler and the executor, outputs out."""
