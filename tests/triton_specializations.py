"""Which compiled kernels chapter 06's Triton backend needs, worked out without a GPU.

Triton compiles a kernel once per *specialization* of its arguments: the values of the
compile-time constants, and for the others their type and what Triton assumes of them (an
integer equal to 1 becomes a constant, one divisible by 16 is marked so, and so is a pointer
aligned to 16 bytes). A step that needs a specialization nobody compiled stops for a compile
(about a second on a GPU) while every running request waits.

Run as a script, with Triton's CPU interpreter off (TRITON_INTERPRET unset): the kernels'
launches are recorded instead of run, and Triton's own argument binder for an sm_90 target
names the specialization each launch needs. It prints, as JSON, the specializations
`TritonPagedAttention.warm_up` compiles and those of a few real steps (decodes whose block
tables are 1, 3, 16 and 17 blocks wide, prompt chunks cut into odd and even numbers of
query tiles, mixed with decodes).
"""

from __future__ import annotations

import json
import os

KERNELS = ("_store_kv_kernel", "_decode_kernel", "_combine_splits_kernel", "_prefill_kernel")
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 2, 64

# A real step: each sequence's (new tokens, tokens in all).
REAL_STEPS = {
    "decode, tables 1 block wide": [(1, 9), (1, 16)],
    "decode, tables 3 blocks wide": [(1, 40), (1, 33)],
    "decode, tables 16 blocks wide": [(1, 250), (1, 240)],
    "decode, a table 17 blocks wide": [(1, 270)],
    "a prompt chunk of 100 tokens (7 query tiles)": [(100, 100)],
    "a prompt chunk of 100 tokens and a decode (8 query tiles)": [(100, 100), (1, 40)],
    "a chunk of 20 after 300 cached tokens and a decode (3 query tiles)": [(20, 320), (1, 5)],
}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", (
        "needs Triton's compiler, not its interpreter"
    )
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    from minivllm.attention import triton_paged
    from minivllm.attention.backend import AttentionMetadata, PagedKVCache, slot_mapping
    from minivllm.utils import cdiv

    launches: list[tuple[str, tuple, dict]] = []
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    binders = {}
    for name in KERNELS:
        kernel = getattr(triton_paged, name)
        binders[name] = create_function_from_signature(kernel.signature, kernel.params, backend)

        def record(*args, grid, warmup, name=name, **kwargs):
            launches.append((name, args, kwargs))

        kernel.run = record

    def specializations() -> list[list]:
        keys = set()
        for name, args, kwargs in launches:
            _, specialization, _ = binders[name](*args, **kwargs)
            keys.add((name, tuple(map(str, specialization))))
        launches.clear()
        return sorted([name, list(key)] for name, key in keys)

    class Shapes:  # what PagedKVCache reads of a model's config
        num_layers, num_kv_heads, head_dim = 1, NUM_KV_HEADS, HEAD_DIM

    kv = PagedKVCache(
        Shapes, num_blocks=600, block_size=BLOCK_SIZE, dtype=torch.bfloat16, device="cpu"
    )
    triton_paged.TritonPagedAttention.warm_up(kv, NUM_HEADS, max_num_seqs=8, max_num_tokens=256)
    warm_up = specializations()

    steps = {}
    for label, sequences in REAL_STEPS.items():
        query_lens = [new for new, _ in sequences]
        seq_lens = [total for _, total in sequences]
        tables = [
            list(range(40 * i, 40 * i + cdiv(total, BLOCK_SIZE)))
            for i, total in enumerate(seq_lens)
        ]
        slots = []
        for table, new, total in zip(tables, query_lens, seq_lens):
            slots += slot_mapping(table, BLOCK_SIZE, total - new, total)
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, slots)
        attention = triton_paged.TritonPagedAttention(kv, metadata)
        num_tokens = sum(query_lens)
        q = torch.zeros(num_tokens, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        k = torch.zeros(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        attention(0, q, k, k)
        steps[label] = specializations()
    print(json.dumps({"warm_up": warm_up, "steps": steps}))


if __name__ == "__main__":
    main()
