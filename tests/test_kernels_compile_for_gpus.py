"""Chapter 06's Triton kernels, compiled for real NVIDIA chips on a machine with no GPU.

Triton ships NVIDIA's assembler (ptxas), so its compiler can build a kernel for a target chip
without one: `triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda",
90, 32))` lowers it through Triton's IR and PTX to the chip's machine code (a cubin). A kernel
that asks for more shared memory or registers than the chip has compiles on a CPU machine but
fails at its first launch on the GPU; this test finds that here. It compiles every kernel the
"triton" backend launches, with the compile-time constants the engine would pass
(`store_constants`, `decode_constants`, `combine_constants`, `prefill_constants`), for the A100
(sm_80) and the H100/H200 (sm_90), over the dtypes, head sizes, grouped-query ratios and decode
split counts the engine can meet, and checks each cubin's shared memory and registers against
the chip's limits (read from the cubin by `cuobjdump`, which Triton ships too).

Kernels are compiled in a child process: the test session runs Triton's CPU interpreter
(TRITON_INTERPRET=1, chapter 06's tests), under which `triton.jit` gives functions that only
the interpreter runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Chip:
    name: str
    capability: int
    max_shared_bytes: int  # per block, with the opt-in carve-out
    registers_per_block: int = 65536
    max_registers_per_thread: int = 255


CHIPS = (
    Chip("A100 (sm_80)", 80, 163 * 1024),
    Chip("H100/H200 (sm_90)", 90, 227 * 1024),
)
# (dtype, head_dim, query heads per K/V head) of the attention kernels compiled, per chip. A
# kernel's tiles are set by its dtype and its head dimension padded to a power of two (64 -> 64;
# 80, 128 -> 128), so the widest tiles (128) bound shared memory and registers: the H100 gets
# every dtype at 128, float32 at 64 and the non-power-of-two 80 with 8 queries per K/V head; the
# A100, with less shared memory per block, its largest-tiled case. Compiling costs 1-13 s
# a kernel on 2 cores; this is about a minute in all.
ATTENTION_CASES = {
    90: [
        ("float32", 128, 4),
        ("bfloat16", 128, 4),
        ("float16", 128, 4),
        ("float32", 64, 1),
        ("bfloat16", 80, 8),
    ],
    80: [("float32", 128, 4)],
}
# Decode splits (a compile-time constant, one of SPLIT_COUNTS): the smallest and largest, for
# one case; the count sets only a loop's bounds, not the tiles.
SPLITS_CASE, SPLITS = ("bfloat16", 128, 4), (1, 64)
BLOCK_SIZE = 16  # the engine's default tokens per KV block


@dataclass
class Compiled:
    kernel: str
    chip: str
    settings: str
    shared_bytes: int
    registers: int
    spilled_bytes: int  # local memory per thread
    threads: int


def pointer(dtype: str) -> str:
    return {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16", "int64": "*i64"}[dtype]


def kernel_cases(capability: int):
    """(kernel name, signature, constants, description) of every launch to compile for a chip."""
    import torch

    from minivllm.attention import triton_paged as tp

    for dtype_name, head_dim, group in ATTENTION_CASES[capability]:
        dtype = getattr(torch, dtype_name)
        data = pointer(dtype_name)
        case = f"{dtype_name}, head_dim {head_dim}, {group} queries per K/V head"
        yield (
            "_store_kv_kernel",
            dict(
                k_ptr=data, v_ptr=data, k_cache_ptr=data, v_cache_ptr=data,
                slot_mapping_ptr="*i64", row_size="i32", BLOCK="constexpr",
            ),
            tp.store_constants(8 * head_dim),  # 8 K/V heads a row
            f"{dtype_name}, rows of 8 x {head_dim}",
        )  # fmt: skip
        splits = SPLITS if (dtype_name, head_dim, group) == SPLITS_CASE else (1,)
        for num_splits in splits:
            yield (
                "_decode_kernel",
                dict(
                    q_ptr=data, k_cache_ptr=data, v_cache_ptr=data, block_tables_ptr="*i64",
                    seq_lens_ptr="*i64", partial_out_ptr="*fp32", partial_lse_ptr="*fp32",
                    scale="fp32", head_dim="i32", num_kv_heads="i32", block_table_stride="i32",
                    **dict.fromkeys(
                        ("QUERIES_PER_KV", "GROUP_PAD", "HEAD_DIM_PAD", "PAGE_SIZE",
                         "NUM_SPLITS", "BLOCK_N", "PRECISION"),
                        "constexpr",
                    ),
                ),
                tp.decode_constants(group, head_dim, BLOCK_SIZE, num_splits, dtype),
                f"{case}, {num_splits} splits",
            )  # fmt: skip
        yield (
            "_prefill_kernel",
            dict(
                q_ptr=data, out_ptr=data, k_cache_ptr=data, v_cache_ptr=data,
                block_tables_ptr="*i64", seq_lens_ptr="*i64", query_start_loc_ptr="*i64",
                tile_seqs_ptr="*i64", tile_starts_ptr="*i64", scale="fp32", head_dim="i32",
                num_kv_heads="i32", block_table_stride="i32",
                **dict.fromkeys(
                    ("QUERIES_PER_KV", "TOKENS_PER_TILE", "HEAD_DIM_PAD", "PAGE_SIZE",
                     "BLOCK_M", "BLOCK_N", "PRECISION"),
                    "constexpr",
                ),
            ),
            tp.prefill_constants(group, head_dim, BLOCK_SIZE, dtype),
            case,
        )  # fmt: skip
    for head_dim in (64, 128):
        for num_splits in SPLITS:
            yield (
                "_combine_splits_kernel",
                dict(
                    partial_out_ptr="*fp32", partial_lse_ptr="*fp32", out_ptr="*fp32",
                    head_dim="i32", NUM_SPLITS="constexpr", SPLITS_PAD="constexpr",
                    HEAD_DIM_PAD="constexpr",
                ),
                tp.combine_constants(num_splits, head_dim),
                f"head_dim {head_dim}, {num_splits} splits",
            )  # fmt: skip


def resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers per thread, static shared bytes, local bytes per thread) of the cubin's one
    kernel, by cuobjdump. Local memory is where registers spill when a thread needs more than
    the 255 it may have: slower, but it runs."""
    import triton.backends.nvidia as nvidia

    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    registers, shared, local = (
        int(re.search(rf"{field}:(\d+)", report).group(1)) for field in ("REG", "SHARED", "LOCAL")
    )
    return registers, shared, local


def compile_all() -> list[dict]:
    """Compile every case for every chip; the child process's work."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minivllm.attention import triton_paged

    results = []
    for chip in CHIPS:
        target = GPUTarget("cuda", chip.capability, 32)
        for kernel_name, signature, constants, settings in kernel_cases(chip.capability):
            kernel = getattr(triton_paged, kernel_name)
            source = ASTSource(kernel, signature, constants)
            compiled = triton.compile(source, target=target)
            registers, static_shared, local = resource_usage(compiled.asm["cubin"])
            results.append(
                asdict(
                    Compiled(
                        kernel=kernel_name,
                        chip=chip.name,
                        settings=settings,
                        # Triton's tiles live in dynamic shared memory, which the cubin does
                        # not declare: the compiler reports it in the kernel's metadata.
                        shared_bytes=max(compiled.metadata.shared, static_shared),
                        registers=registers,
                        spilled_bytes=local,
                        threads=32 * compiled.metadata.num_warps,
                    )
                )
            )
    return results


@pytest.fixture(scope="module")
def compiled_kernels() -> list[dict]:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__],
        env=environment,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_every_kernel_compiles_for_each_chip(compiled_kernels):
    cases = sum(1 for chip in CHIPS for _ in kernel_cases(chip.capability))
    assert len(compiled_kernels) == cases
    kinds = {(row["kernel"], row["chip"]) for row in compiled_kernels}
    assert len(kinds) == 4 * len(CHIPS)


def test_every_kernel_fits_the_chip(compiled_kernels):
    """Shared memory within the block's limit, registers within a thread's and a block's."""
    limits = {chip.name: chip for chip in CHIPS}
    too_big = []
    for row in compiled_kernels:
        chip = limits[row["chip"]]
        fits = (
            row["shared_bytes"] <= chip.max_shared_bytes
            and row["registers"] <= chip.max_registers_per_thread
            and row["registers"] * row["threads"] <= chip.registers_per_block
        )
        if not fits:
            too_big.append(row)
    assert not too_big, too_big
    # The attention kernels do keep tiles in shared memory: the report reads something real.
    assert any(row["shared_bytes"] > 0 for row in compiled_kernels if "decode" in row["kernel"])
    spills = [
        f"{row['kernel']} {row['chip']} {row['settings']}: {row['spilled_bytes']} B"
        for row in compiled_kernels
        if row["spilled_bytes"]
    ]
    print("register spills (slower, not an error):", spills or "none")


if __name__ == "__main__":
    print(json.dumps(compile_all()))
