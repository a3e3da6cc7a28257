"""Chapter 00 (notebooks/00-the-model.ipynb) on a GPU: our logits against transformers'.

Chat prompts of 20-1000 tokens go through our model and through transformers' in float32; the
record holds the largest difference per prompt and a histogram of every logit's difference,
and whether the argmax agrees at every position (the greedy token would). The notebook's
section "On a GPU" draws both, next to its own prompts: no figure here.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from minivllm.baselines.naive import CausalAttention
from minivllm.bench.gpu.common import Chapter, Run
from minivllm.bench.workloads import throughput_workload


@torch.inference_mode()
def measure_logits(run: Run) -> Chapter:
    """Each prompt through both models, compared logit by logit (logit_range: transformers'
    logits, [min, max])."""
    low, high = run.sizes.logit_prompt_lengths
    chat = throughput_workload(run.tokenizer, run.sizes.logit_prompts, (low, high), 1)
    prompts = replace(
        chat,
        name="chat-prompts",
        description=f"{chat.num_requests} chat prompts, {low}-{high} tokens",
    )
    hf_model = run.context().hf_model
    edges = np.linspace(-9, 1, 41)  # log10 |diff|, 4 bins per decade
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    max_per_prompt, same_argmax, lows, highs = [], True, [], []
    for prompt in prompts.prompts:
        ids = torch.tensor(prompt, device=run.device)
        positions = torch.arange(len(prompt), device=run.device)
        ours = run.model.compute_logits(
            run.model(ids, positions, CausalAttention([0, len(prompt)]))
        )
        theirs = hf_model(ids[None]).logits[0]
        diff = (ours - theirs).abs()
        max_per_prompt.append(diff.max().item())
        # Counted on the device: a 1000-token prompt has 49 M logits.
        log10_diff = diff.clamp(1e-9, 10.0).log10()
        counts += torch.histc(log10_diff, len(counts), edges[0], edges[-1]).long().cpu().numpy()
        same_argmax &= torch.equal(ours.argmax(-1), theirs.argmax(-1))
        lows.append(theirs.min().item())
        highs.append(theirs.max().item())
    lengths = [len(p) for p in prompts.prompts]
    print(f"max |ours - transformers| = {max(max_per_prompt):.2e}; same argmax: {same_argmax}")
    measured = dict(
        prompt_lengths=lengths,
        max_abs_diff_per_prompt=max_per_prompt,
        max_abs_diff=max(max_per_prompt),
        same_argmax=same_argmax,
        logit_range=[min(lows), max(highs)],
        abs_diff_histogram=dict(log10_edges=edges.tolist(), counts=counts.tolist()),
    )
    return Chapter("00-logits", prompts, measured=measured)
