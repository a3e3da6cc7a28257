"""Chapter 07 — the tensor-parallel group: which rank am I, how many are we, and the two
collectives a split model needs.

A model split over N processes ("ranks") needs only two kinds of communication:

- **all-reduce** (sum): after a row-parallel layer every rank holds a partial sum of the same
  output; adding them up on every rank gives the full result (chapter 07's figure).
- **gather** to rank 0: the LM head's vocabulary is split, so each rank computes logits for its
  slice of the vocabulary; rank 0 samples and needs all of them.

and one way to tell the other ranks what to do next (`broadcast_object`: rank 0 sends each
step's plain-data scheduler output). All three run on `torch.distributed`: gloo on the CPU,
NCCL between GPUs (objects always travel over gloo, which speaks CPU memory). Processes meet
at a rendezvous address (`tcp://host:port`, or torchrun's `env://`), the same code on one
machine or many.

A model that is not split gets `SINGLE_PROCESS`, a group of one whose collectives return
their input untouched: chapter 00's model is the tensor-parallel model with N = 1.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a rank waits in a collective before giving up. Ranks wait for each other while a
# peer computes (a long prefill on a slow CPU) and, between requests, for the next step, so
# the wait for the next command is unbounded (see `init_tensor_parallel`). A rank that dies
# closes its connections, and gloo reports that at once: failures do not wait for timeouts.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks one model is split across, as seen from one of them."""

    rank: int = 0
    size: int = 1
    device_group: Any = None  # tensors: NCCL between GPUs, gloo on the CPU
    cpu_group: Any = None  # pickled objects (scheduler outputs, results): always gloo

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler and samples; the others follow."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the sum."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's x along `dim`, in rank order, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, pieces, dst=0, group=self.device_group)
        return torch.cat(pieces, dim=dim) if self.is_driver else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (pickled; the others pass nothing)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        gathered = [None] * self.size if self.is_driver else None
        dist.gather_object(obj, gathered, dst=0, group=self.cpu_group)
        return gathered


SINGLE_PROCESS = TensorParallelGroup()


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device, store: Any = None
) -> TensorParallelGroup:
    """Join the rendezvous at `init_method` (or the already connected `store`) as `rank` of
    `size` and build the group.

    One process holds one rank of one group: torch.distributed's default group is per process,
    so a second tensor-parallel engine in the same process must wait until the first has shut
    down (`destroy_tensor_parallel`).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "this process already holds a tensor-parallel group; shut the other "
            "tensor-parallel engine down (del llm) before starting another"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    rendezvous = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(
        backend, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **rendezvous
    )
    # Followers wait in this group's broadcast for the next command, however long the engine
    # stays idle; the tensor collectives keep the finite timeout.
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallelGroup(rank, size, dist.group.WORLD, cpu_group)


def abort_collectives() -> None:
    """Make every collective this process is waiting in fail now, from another thread: what a
    rank does when it learns a peer is gone. NCCL would otherwise wait for COLLECTIVE_TIMEOUT;
    gloo already fails at once on the closed connection, and has nothing to abort."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()


def destroy_tensor_parallel() -> None:
    """Leave the group (so the process can join another later)."""
    if dist.is_initialized():
        dist.destroy_process_group()
