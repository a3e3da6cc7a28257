"""Chapter 11, the step's parts beside vLLM's: operators sorted into the same kinds for both."""

from __future__ import annotations

import torch

from minivllm.bench import op_profile


def test_both_engines_operators_fall_into_the_same_parts():
    self_seconds = {
        "mkldnn::_linear_pointwise": 5.0,  # minivllm's linear layers
        "_C::onednn_mm": 4.0,  # vLLM's
        "minivllm_cpu::paged_attention": 2.0,
        "_C::cpu_attention_with_kv_cache": 1.0,
        "## Call CompiledFxGraph abc123": 0.5,
        "aten::empty": 0.25,
    }
    parts = op_profile.parts_of(self_seconds)
    assert list(parts) == [*op_profile.PARTS, "other"]
    assert parts["linear layers"] == 9.0 and parts["attention kernel"] == 3.0
    assert parts["fused elementwise graph"] == 0.5 and parts["other"] == 0.25
    assert sum(parts.values()) == sum(self_seconds.values())


def test_a_profiled_run_counts_its_matrix_products():
    a = torch.randn(256, 256)
    seconds = op_profile.profile_self_seconds(lambda: [a @ a for _ in range(5)])
    parts = op_profile.parts_of(seconds)
    assert parts["linear layers"] > 0 and parts["attention kernel"] == 0
