"""Chapter 11 — CUDA graphs: a decode step recorded once per batch size, replayed every step.

On a GPU the eager step is mostly waiting: a decode step of a 30-layer model launches about 1,100
kernels (chapter 11 counts them), each costing the CPU a few microseconds to launch, while reading
a small model's weights from HBM takes a few tens of microseconds in all. A CUDA graph records the
kernels of one forward (their arguments are device addresses) and replays the whole sequence with
one launch.

A recording is only good for the addresses and sizes it saw, so, as vLLM does for the first two:

- **Buckets.** One graph per batch size in `capture_sizes` (1, 2, 4, 8, then every multiple of
  8, vLLM's `cudagraph_capture_sizes`); a step of n decodes replays the smallest bucket >= n,
  its extra rows padding.
- **Persistent inputs** (`GraphInputs`). Token ids, positions, slots, sequence lengths and block
  tables live in buffers allocated once; each step copies its values into them before the
  replay, and the recorded kernels read them in place. The block tables are as wide as the
  engine's longest context; a step writes only the blocks that changed and copies only the
  columns its tables reach.
- **Padding that harms nothing.** A padding row is a sequence of one token whose K/V go to a
  block no request ever owns (the pool's last block, kept out of the scheduler's pool), and
  whose block table names that block alone. This is minivllm's choice: vLLM gives a padding row
  the slot -1 (PAD_SLOT_ID), which its cache-write kernel skips; the Triton store kernel here
  skips negative slots too, but the torch reference's `index_copy_` would not.
- **Decode only.** A step with a prompt chunk (or drafts to verify) has shapes no bucket holds
  and runs without a graph. (vLLM also records piecewise graphs, the compiled graph split at
  attention, which serve prefills and mixed batches with attention run between the pieces.)
  Only the Triton backend (chapter 06) can be recorded: its decode kernel reads lengths and
  block tables from the device; the torch reference plans its work in Python from lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.attention.backend import AttentionMetadata, PagedAttentionBackend, PagedKVCache
from minivllm.utils import cdiv


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to record: 1, 2, 4, 8, then multiples of 8, up to the first one that
    holds max_num_seqs (so every decode step has a bucket)."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    last = next(i for i, size in enumerate(sizes) if size >= max_num_seqs)
    return sizes[: last + 1]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest recorded size that holds `num_seqs` decodes; None when none does."""
    return next((size for size in sizes if size >= num_seqs), None)


@dataclass
class GraphInputs:
    """The buffers a recorded decode step reads: room for the largest bucket."""

    input_ids: torch.Tensor  # [max_size]
    positions: torch.Tensor  # [max_size]
    slot_mapping: torch.Tensor  # [max_size]
    seq_lens: torch.Tensor  # [max_size]
    block_tables: torch.Tensor  # [max_size, max_blocks_per_seq]
    padding_block: int  # the pool block that padding rows write to and read
    # The block tables as the CPU writes them, kept from step to step (pinned with a GPU, so
    # they cross without the CPU waiting), and the table each row of them begins with.
    host_block_tables: torch.Tensor
    row_tables: list[list[int]]

    @classmethod
    def allocate(
        cls, max_size: int, max_blocks_per_seq: int, padding_block: int, device: torch.device
    ) -> GraphInputs:
        device = torch.device(device)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        def padding_tables(where: torch.device, pin_memory: bool = False) -> torch.Tensor:
            shape = (max_size, max_blocks_per_seq)
            return torch.full(
                shape, padding_block, dtype=torch.long, device=where, pin_memory=pin_memory
            )

        return cls(
            zeros(max_size),
            zeros(max_size),
            zeros(max_size),
            zeros(max_size),
            padding_tables(device),
            padding_block,
            padding_tables(torch.device("cpu"), pin_memory=device.type == "cuda"),
            [[] for _ in range(max_size)],
        )

    def metadata(self, size: int, block_size: int) -> AttentionMetadata:
        """The attention metadata of a `size`-row decode step, whose tensors are views of the
        buffers (what a recording reads on every replay). Its lists describe the worst case
        (every sequence as long as the table allows), which is all a graph-safe backend reads
        of them: its launch parameters must hold for whatever the buffers hold later."""
        longest = self.block_tables.shape[1] * block_size
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=torch.arange(size + 1, device=self.seq_lens.device),
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_list=[1] * size,
            seq_lens_list=[longest] * size,
            block_tables_list=[[self.padding_block]] * size,
        )

    def fill(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        size: int,
        block_size: int,
    ) -> None:
        """Copy one decode step (a row per sequence) into the first rows, and make rows
        len(input_ids)..size-1 padding: one token at the padding block's first slot.

        The buffer's block tables are as wide as the longest context, thousands of columns for
        a long-context model, and a step's tables are mostly the last step's. So only what
        changed is written, into the CPU's tables (`_write_row`), and only the columns up to
        the step's widest table are copied over. Columns past a row's own blocks may still
        hold what the row held before: the decode kernel reads a table no further than its
        sequence's last block."""
        num_real = len(input_ids)
        padding = size - num_real
        device = self.input_ids.device

        def put(buffer: torch.Tensor, values: list[int], pad: int) -> None:
            row = torch.tensor(values + [pad] * padding, dtype=torch.long)
            buffer[:size].copy_(row.to(device))

        put(self.input_ids, input_ids, 0)
        put(self.positions, positions, 0)
        put(self.slot_mapping, slot_mapping, self.padding_block * block_size)
        put(self.seq_lens, seq_lens, 1)
        tables = block_tables + [[self.padding_block]] * padding
        for row, table in enumerate(tables):
            self._write_row(row, table)
        columns = max(len(table) for table in tables)
        # Not waiting for the copy is safe: the replay after it is queued on the same stream,
        # and the CPU writes these rows again only after the step's sampled tokens have come
        # back, which waits for the stream.
        self.block_tables[:size, :columns].copy_(
            self.host_block_tables[:size, :columns], non_blocking=True
        )

    def _write_row(self, row: int, table: list[int]) -> None:
        """Make row `row` of the CPU's tables begin with `table`: nothing to write when it is
        the table the row holds, only the new blocks when that table grew."""
        held = self.row_tables[row]
        kept = len(held) if table[: len(held)] == held else 0
        if kept < len(table):
            new_blocks = torch.tensor(table[kept:], dtype=torch.long)
            self.host_block_tables[row, kept : len(table)] = new_blocks
        self.row_tables[row] = list(table)


Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionBackend], torch.Tensor]


class CUDAGraphRunner:
    """Records `forward` (the model, eager or compiled) for every decode bucket, and replays
    the right one for a decode step."""

    def __init__(
        self,
        forward: Forward,
        kv_cache: PagedKVCache,
        attention_backend: type[PagedAttentionBackend],
        max_num_seqs: int,
        max_model_len: int,
    ):
        self.forward = forward
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.block_size = kv_cache.block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.device = kv_cache.layers[0].device
        self.inputs = GraphInputs.allocate(
            self.sizes[-1],
            cdiv(max_model_len, self.block_size),
            padding_block=kv_cache.num_blocks - 1,
            device=self.device,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's output buffer

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket, largest first: the smaller graphs then fit in the memory pool
        the largest one reserved."""
        memory_pool = None
        for size in reversed(self.sizes):
            self.inputs.fill([], [], [], [], [], size, self.block_size)  # all padding
            attention = self.attention_backend(
                self.kv_cache, self.inputs.metadata(size, self.block_size)
            )
            ids, positions = self.inputs.input_ids[:size], self.inputs.positions[:size]
            self.forward(ids, positions, attention)  # compiles and autotunes outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool):
                self.outputs[size] = self.forward(ids, positions, attention)
            memory_pool = graph.pool()
            self.graphs[size] = graph

    def bucket(self, query_lens: list[int]) -> int | None:
        """The bucket a step replays, or None when it must run without a graph (a prompt
        chunk or drafts in it, or more sequences than the largest bucket)."""
        if any(n != 1 for n in query_lens):
            return None
        return bucket_for(len(query_lens), self.sizes)

    def run(
        self,
        size: int,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Hidden states of one decode step, [num_seqs, hidden], from the `size` graph."""
        self.inputs.fill(
            input_ids, positions, slot_mapping, seq_lens, block_tables, size, self.block_size
        )
        self.graphs[size].replay()
        return self.outputs[size][: len(input_ids)]
