"""The contract between the model runner and an attention kernel: the KV pool's layout, the
step's metadata, the backend interface, and the registry that picks a backend by name.

Chapter 03 writes one backend (`attention/torch_paged.py`, the readable reference); kernels
that read the pool in place register here too. They all honour the same contract, so the
model runner never changes when the kernel does:

- **The pool** (`PagedKVCache`): per layer one tensor `[2 (K, V), num_blocks, block_size,
  num_kv_heads, head_dim]`. A token's slot is `block_id * block_size + offset`.
- **The step** (`AttentionMetadata`): the flat batch's sequences — where each one's new
  tokens start (`query_start_loc`), how long each is after this step (`seq_lens`), its blocks
  (`block_tables`) and the slot of every new token (`slot_mapping`).
- **A backend** is built once per step from the pool and the metadata (anything it prepares
  then is reused by every layer) and is called once per layer, as the model calls any
  attention: `backend(layer_index, q, k, v)`. It must write the new tokens' K and V into the
  pool at `slot_mapping` and return, for every new token, attention over the tokens of its own
  sequence up to and including itself (cached ones and this step's), `[tokens, heads, dim]`.

    backend_class = get_attention_backend("torch")
    attention = backend_class(kv_cache, metadata)   # once per step
    hidden = model(input_ids, positions, attention)  # calls attention(layer, q, k, v) per layer
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from minivllm.config import ModelConfig


class PagedKVCache:
    """The pool: per layer one tensor [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.layers = [zeroed_pool(shape, dtype, device) for _ in range(config.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def num_blocks_for_budget(
        configs: list[ModelConfig], block_size: int, dtype: torch.dtype, memory_bytes: int
    ) -> int:
        """How many blocks a memory budget holds, for pools that share block tables: the
        model's, and in chapter 08 a draft model's (a block then holds its tokens' K/V in
        both)."""
        bytes_per_token = sum(config.kv_bytes_per_token(dtype) for config in configs)
        return memory_bytes // (block_size * bytes_per_token)


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of zeros whose CPU memory is paid for as it is used (chapter 12). `torch.zeros`
    writes every byte at once, so a 2 GiB pool is 2 GiB resident before the first request.
    An anonymous memory map (what C's `calloc` does for a large block) has pages that read as
    zeros and become resident only when first written: an engine holds the blocks its requests
    have filled. The map asks for ordinary 4 KiB pages: where the kernel may back a region with
    2 MiB pages, the first write into each 2 MiB may first wait for it to compact memory, which
    made storing a fresh block's K/V several times slower. On a GPU every byte is allocated up
    front anyway."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or num_bytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, num_bytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8, count=num_bytes).view(dtype).view(shape)


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat pool indices of the K/V of a sequence's tokens at positions start..end-1:
    slot = block_id * block_size + offset."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass
class AttentionMetadata:
    """The shape of one step's flat batch, as every attention backend reads it.

    query_start_loc  [0, 1, 2, 130]   sequence i's new tokens are rows qsl[i]:qsl[i+1]
    seq_lens         [57, 9, 300]     tokens of each sequence *after* this step
    block_tables     [[4, 7, 0, 0],   physical blocks of each sequence, padded with 0
                      [2, 0, 0, 0],
                      [1, 3, 5, ...]]
    slot_mapping     [..]             pool slot of each new token: where its K/V go
    """

    slot_mapping: torch.Tensor  # [num_tokens] pool slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] where each sequence's new tokens start
    seq_lens: torch.Tensor  # [num_seqs] context + new tokens of each sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] physical block ids, padded with 0
    # The same numbers as Python lists, so loops over sequences need no device sync.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_tables_list: list[list[int]]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        width = max(len(table) for table in block_tables)
        padded = [table + [0] * (width - len(table)) for table in block_tables]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(query_starts(query_lens), dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            block_tables_list=[list(table) for table in block_tables],
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


def query_starts(query_lens: list[int]) -> list[int]:
    """Cumulative sums from 0: where each sequence's rows start in the flat batch."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


class PagedAttentionBackend(ABC):
    """One step's attention over the paged pool; see the module docstring for the contract."""

    name: ClassVar[str]  # what `attention_backend=` calls it

    def __init__(self, kv_cache: PagedKVCache, metadata: AttentionMetadata):
        self.kv_cache = kv_cache
        self.metadata = metadata

    @classmethod
    def for_device(cls, device: torch.device) -> type[PagedAttentionBackend]:
        """The backend to use on `device`: this one (the reference runs anywhere), another one
        it falls back to, or a ValueError saying why it cannot run there."""
        return cls

    @classmethod
    def warm_up(
        cls, kv_cache: PagedKVCache, num_heads: int, max_num_seqs: int, max_num_tokens: int
    ) -> None:
        """Prepare before serving (compile kernels for every shape a step can take), so that
        no request waits for it. The reference needs nothing."""
        return None

    @abstractmethod
    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


# name -> "module:class". Modules are imported only when their backend is chosen, so a machine
# without Triton can still run the torch backend.
ATTENTION_BACKENDS = {
    "torch": "minivllm.attention.torch_paged:TorchPagedAttention",
    "triton": "minivllm.attention.triton_paged:TritonPagedAttention",  # chapter 06
    "flex": "minivllm.attention.flex_paged:FlexPagedAttention",  # chapter 06
    "cpu": "minivllm.attention.cpu_paged:CpuPagedAttention",  # chapter 06, in C++
}


def resolve_attention_backend_name(name: str, device: torch.device) -> str:
    """ "auto" picks the best registered backend for the device: chapter 06's Triton kernels on
    a CUDA GPU, its C++ kernel on a CPU (which falls back to the torch reference where it
    cannot be built), the torch reference elsewhere. Any other name must be registered."""
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_is_installed() else "torch"
        return "cpu" if device.type == "cpu" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be 'auto' or one of {sorted(ATTENTION_BACKENDS)}, got {name!r}"
        )
    return name


def triton_is_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def get_attention_backend(name: str) -> type[PagedAttentionBackend]:
    """The backend class registered under `name`."""
    module_name, class_name = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
