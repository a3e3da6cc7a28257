"""Chapter 11 — the cost of a step: the model compiled (torch.compile), and on a GPU replayed
from CUDA graphs."""
