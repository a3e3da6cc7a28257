"""Chapter 03 (notebooks/03-paged-kv-blocks.ipynb) on a GPU: the KV memory paged blocks save.

The engine (no prefix caching) runs the varied-output workload step by step; after each step
we count the tokens its running requests hold, the slots of the blocks they hold, and what a
contiguous cache would reserve for the same requests (of each one's exact final length, or of
the longest sequence allowed). Then paged decode attention against the block size. The notebook's
section "On a GPU" draws the share of memory holding tokens and the attention's time; the figure
here draws the memory step by step, which it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch

from minivllm.attention.torch_paged import TorchPagedAttention
from minivllm.bench.benchmark import greedy_params
from minivllm.bench.gpu.common import DTYPE, Chapter, MiB, Run, decode_attention_step, quoted, style
from minivllm.bench.workloads import Workload
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine

# What a contiguous cache reserves per request when it cannot know the final length: the
# longest sequence allowed (the vLLM paper's 2048, or the model's context if shorter).
MAX_RESERVATION = 2048
BLOCK_SIZE = 16


def measure_memory_waste(run: Run) -> Chapter:
    """JSON: per_step (`trace_kv_memory`); token_share {scheme: tokens held / slots reserved,
    summed over the steps}; attention_seconds (`paged_attention_call` at each of
    attention_block_sizes, the block sizes interleaved in rounds)."""
    workload = run.varied_workload()
    max_reservation = min(MAX_RESERVATION, run.model.config.max_model_len)
    per_step = trace_kv_memory(run, workload, max_reservation)
    token_share = {
        scheme: sum(per_step["tokens_held"]) / sum(per_step[f"{scheme}_slots"])
        for scheme in ("paged", "contiguous_final", "contiguous_max")
    }
    print(
        "share of reserved KV memory holding tokens:",
        {k: f"{v:.1%}" for k, v in token_share.items()},
    )
    block_sizes = list(run.sizes.block_sizes)
    with torch.inference_mode():  # as in the engine: no autograd records, K/V written in place
        calls = {size: paged_attention_call(run, size) for size in block_sizes}
        attention = quoted("attention_seconds", run.sweep(calls))

    per_token = run.model.config.kv_bytes_per_token(DTYPE)
    measured = dict(
        per_step=per_step,
        token_share=token_share,
        kv_bytes_per_token=per_token,
        block_size=BLOCK_SIZE,
        max_reservation=max_reservation,
        attention_block_sizes=block_sizes,
        **attention,
        attention_seqs=run.sizes.attention_seqs,
        attention_seq_len=run.sizes.attention_seq_len,
    )
    fig = plot_kv_memory(run, workload, per_step, per_token)
    return Chapter("03-memory-waste", workload, measured=measured, figure=fig)


def trace_kv_memory(run: Run, workload: Workload, max_reservation: int) -> dict[str, list[int]]:
    """Step an engine through the workload (all requests queued at once) and count, after each
    step, the KV slots in use: tokens held, paged blocks, contiguous reservations (of each
    request's final length, or of `max_reservation` tokens)."""
    config = EngineConfig(
        model=str(run.model_dir),
        dtype=DTYPE,
        device=run.device,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,  # chapter 05's sharing off: one owner per block
        kv_cache_memory_bytes=run.kv_budget(workload, DTYPE, BLOCK_SIZE),
    )
    engine = LLMEngine(config)
    for i, (prompt, params) in enumerate(zip(workload.prompts, greedy_params(workload))):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    manager = engine.kv_cache_manager
    per_step = {
        name: []
        for name in ("tokens_held", "paged_slots", "contiguous_final_slots", "contiguous_max_slots")
    }
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        per_step["tokens_held"].append(sum(r.num_computed_tokens for r in running))
        per_step["paged_slots"].append((manager.num_blocks - manager.num_free_blocks) * BLOCK_SIZE)
        per_step["contiguous_final_slots"].append(
            sum(len(r.prompt_token_ids) + r.max_tokens for r in running)
        )
        per_step["contiguous_max_slots"].append(len(running) * max_reservation)
    return per_step


def plot_kv_memory(
    run: Run, workload: Workload, per_step: dict[str, list[int]], per_token: int
) -> plt.Figure:
    """The KV memory the running requests hold after each engine step: the tokens, their
    paged blocks, and contiguous reservations of each request's exact final length."""
    fig, ax = run.figure("KV memory: contiguous vs paged", workload, (9, 4.4))
    steps = np.arange(1, len(per_step["tokens_held"]) + 1)
    mib = {name: np.array(values) * per_token / MiB for name, values in per_step.items()}
    ax.fill_between(steps, mib["tokens_held"], step="post", alpha=0.5, label="holding tokens")
    ax.step(steps, mib["paged_slots"], where="post", label=f"paged, blocks of {BLOCK_SIZE}")
    label = "contiguous, exact final length"
    ax.step(steps, mib["contiguous_final_slots"], where="post", label=label)
    title = "memory held by the running requests"
    style(ax, "engine step", "KV cache memory (MiB)", title, legend=8)
    return fig


def paged_attention_call(run: Run, block_size: int) -> Callable[[], torch.Tensor]:
    """One decode-attention call (one query per sequence) over a pool of `block_size` blocks,
    each sequence's blocks scattered at random, one layer of the model's shapes."""
    sizes = run.sizes
    pool, step = decode_attention_step(
        run, sizes.attention_seqs, sizes.attention_seq_len, block_size
    )
    attention = TorchPagedAttention(pool, step.metadata)
    return partial(attention, 0, step.q, step.k, step.v)
