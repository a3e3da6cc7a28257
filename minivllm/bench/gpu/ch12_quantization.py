"""Chapter 12 (notebooks/12-bytes.ipynb) on a GPU: weight-only quantization.

The engine with its weights in float32, bfloat16, int8 and int4 (both quantized at load, the
activations in bfloat16: tinygemm's int4 kernel takes bfloat16 only) and, on the embedded
model, the GGUF file's own 4-bit blocks: one request decoding alone (batch 1, where a step reads
every weight to make one token) and 32 at once (2 in a quick run). Next to each rate, the
memory-bandwidth bound of its scheme (the step's bytes, `roofline.decode_step_cost`, over the
measured bandwidth), the bytes its weights hold once loaded, and the kernel its layers multiply
with (a layer the kernel refuses falls back to a dequantized copy per call: the reference path).
The notebook's section "On a GPU" draws both workloads' output tokens/s, as speedups over
bfloat16, and prints the ratios and the int4 kernel: no figure here.
"""

from __future__ import annotations

import statistics

import torch

from minivllm.bench.gpu.common import Chapter, Run, speedup_records
from minivllm.bench.gpu_results import as_dicts
from minivllm.bench.memory import model_weight_bytes
from minivllm.bench.roofline import decode_step_cost, measure_memory_bandwidth, weight_bytes
from minivllm.bench.workloads import Workload, throughput_workload
from minivllm.models.linear import Linear
from minivllm.models.loader import gguf_file_of
from minivllm.models.quantization import INT8_FUSED_MAX_ROWS, Int4Weight

ENGINE = "engine-no-prefix-cache"
BASELINE = f"{ENGINE}@bfloat16"  # every ratio is over the bfloat16 engine
# Scheme -> (method, weights' quantization, activations' dtype), in the order they run.
SCHEMES = {
    "float32": (ENGINE, None, torch.float32),
    "bfloat16": (BASELINE, None, torch.bfloat16),
    "int8": (f"{ENGINE}:int8@bfloat16", "int8", torch.bfloat16),
    "int4": (f"{ENGINE}:int4@bfloat16", "int4", torch.bfloat16),
    "gguf": (f"{ENGINE}:gguf@bfloat16", "gguf", torch.bfloat16),
}
QUICK_SCHEMES = ("bfloat16", "int4")  # a quick run checks the plumbing: an engine start each
BATCH, QUICK_BATCH = 32, 2  # requests decoding at once in the batched workload


def measure_quantization(run: Run) -> Chapter:
    """Each workload's requests decode `single_output` tokens.

    JSON: results (batch 1) and batched {batch_size, workload, results} (BATCH requests:
    `record | record["batched"]` plots like the record); ratios {"batch1", "batched"} -> scheme
    -> its output tokens/s over bfloat16's, the ratios taken within rounds; weight_bytes scheme
    -> {"loaded": the bytes the engine's model holds, each copy once (a tied table plain and
    packed), "model": `roofline.weight_bytes`}; bounds (decode only, prefill left out);
    int4_kernel ("... (reference)" where tinygemm did not run); int8_fused_max_rows (rows up to
    which int8 uses its fused kernel: above, a dequantized copy per call, as in the batched
    workload's logits).
    """
    gguf_skipped = None
    try:
        gguf_file_of(run.model_dir)
    except ValueError as error:
        gguf_skipped = f"{run.model_name}: {error}"
    schemes = [
        scheme
        for scheme in (QUICK_SCHEMES if run.quick else SCHEMES)
        if scheme != "gguf" or gguf_skipped is None
    ]
    methods = [SCHEMES[scheme][0] for scheme in schemes]
    batch = QUICK_BATCH if run.quick else BATCH
    output = run.sizes.single_output
    single = throughput_workload(run.tokenizer, 1, output_length=output)
    batched = throughput_workload(run.tokenizer, batch, output_length=output)
    # One context for both workloads: each engine starts (and compiles) once. The batched
    # workload runs first, so that the KV pool sized for the first workload holds both.
    ctx = run.context(engine_args=dict(max_num_seqs=batch))
    batched_results = run.benchmark(ctx, batched, methods)
    results = run.benchmark(ctx, single, methods)

    models = {
        scheme: engine_model(ctx, SCHEMES[scheme][0], SCHEMES[scheme][2]) for scheme in schemes
    }
    kernels = {scheme: layer_kernels(model) for scheme, model in models.items()}
    int4_kernel = next(
        (
            module.quantized.kernel
            for module in models["int4"].modules()
            if isinstance(module, Linear) and isinstance(module.quantized, Int4Weight)
        ),
        None,
    )
    bandwidth = measure_memory_bandwidth(
        run.device, megabytes=run.sizes.copy_megabytes, repeats=run.sizes.repeats
    )
    config = run.model.config
    bounds = []
    for workload, rows in ((single, results), (batched, batched_results)):
        rate = {r.method: r.output_tokens_per_s for r in rows}
        context = mean_decode_context(workload)
        for scheme in schemes:
            method, quantization, dtype = SCHEMES[scheme]
            cost = decode_step_cost(config, dtype, workload.num_requests, context, quantization)
            bound = workload.num_requests * bandwidth / cost.bytes
            bounds.append(
                dict(
                    scheme=scheme,
                    method=method,
                    batch_size=workload.num_requests,
                    context=context,
                    step_bytes=cost.bytes,
                    bound_tokens_per_s=bound,
                    output_tokens_per_s=rate[method],
                    share_of_bound=rate[method] / bound,
                )
            )

    pairs = {scheme: (SCHEMES[scheme][0], BASELINE) for scheme in schemes}
    medians, spreads = speedup_records(dict(batch1=results, batched=batched_results), pairs)
    measured = dict(
        batched=dict(
            batch_size=batch,
            workload=dict(name=batched.name, description=batched.description),
            results=as_dicts(batched_results),
        ),
        schemes=schemes,
        gguf_skipped=gguf_skipped,
        ratios=medians,
        ratio_spreads=spreads,
        memory_bandwidth=bandwidth,
        weight_bytes={
            scheme: dict(
                loaded=model_weight_bytes(model),
                model=weight_bytes(config, SCHEMES[scheme][2], SCHEMES[scheme][1]),
            )
            for scheme, model in models.items()
        },
        bounds=bounds,
        kernels=kernels,
        int4_kernel=int4_kernel,
        int8_fused_max_rows=INT8_FUSED_MAX_ROWS,
    )
    return Chapter("12-quantization", single, results, measured)


def engine_model(ctx, method: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model inside the engine `run_benchmark` built for `method` (kept in the context
    of its dtype, under its name and setting)."""
    name = method.partition("@")[0]
    llm = ctx.with_dtype(dtype).engines[name]
    return llm.llm_engine.executor.driver_worker.model


def layer_kernels(model) -> list[str]:
    """The distinct kernels the model's linear layers multiply with."""
    return sorted(
        {
            module.quantized.kernel if module.quantized is not None else "float"
            for module in model.modules()
            if isinstance(module, Linear)
        }
    )


def mean_decode_context(workload: Workload) -> int:
    """Keys a decode step attends over, on average over the workload's decode steps: each
    request's prompt and half its output."""
    return round(
        statistics.mean(
            len(prompt) + output / 2
            for prompt, output in zip(workload.prompts, workload.output_lengths)
        )
    )
