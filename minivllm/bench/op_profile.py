"""Chapter 11 — the step's parts beside vLLM's: which kinds of operator a whole run spends on.

`step_profile.py` times the engine's phases; this counts operators. torch.profiler records the
self time of every operator a run calls (time inside it, not in the operators it calls), and
both engines run on PyTorch, so the same profiler reads minivllm in this process and vLLM in its
peer process (`VLLMPeer.profile`). Each operator's name says what it does; `PARTS` sorts the
names of both engines into the same few kinds, and what no part names is "other".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# part -> operator names (exact) or prefixes (ending in "*"), minivllm's and vLLM's.
PARTS: dict[str, tuple[str, ...]] = {
    "linear layers": ("mkldnn::_linear_pointwise", "_C::onednn_mm", "aten::addmm", "aten::mm"),
    "attention kernel": (
        "minivllm_cpu::paged_attention",
        "_C::cpu_attention_with_kv_cache",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ),
    "K/V gather": ("aten::index_select",),
    "K/V store": ("minivllm_cpu::store_kv", "_C::cpu_attn_reshape_and_cache", "aten::index_copy_"),
    "attention wrapper": ("minivllm::attention", "vllm::unified_attention_with_output"),
    "fused elementwise graph": ("## Call CompiledFxGraph*",),
}


def part_of(operator: str) -> str:
    for part, names in PARTS.items():
        for name in names:
            if operator == name or (name.endswith("*") and operator.startswith(name[:-1])):
                return part
    return "other"


def parts_of(self_seconds: dict[str, float]) -> dict[str, float]:
    """Operator -> self seconds, summed into PARTS (and "other"), in PARTS' order."""
    parts = dict.fromkeys([*PARTS, "other"], 0.0)
    for operator, seconds in self_seconds.items():
        parts[part_of(operator)] += seconds
    return parts


def profile_self_seconds(run: Callable[[], object]) -> dict[str, float]:
    """Self CPU seconds of every operator that `run()` calls, in this process."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
    return {event.key: event.self_cpu_time_total / 1e6 for event in profiler.key_averages()}


def plot_parts(rows: dict[str, dict[str, float]], title: str, path: str | Path):
    """One horizontal bar per run (label -> parts), its parts stacked, in seconds."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.6))
    labels = list(rows)
    left = [0.0] * len(labels)
    for part in [*PARTS, "other"]:
        widths = [rows[label].get(part, 0.0) for label in labels]
        axes.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    axes.invert_yaxis()
    axes.set_xlabel("self CPU time over the whole run (s)")
    axes.set_title(title)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return figure
