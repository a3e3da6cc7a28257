"""The book's measurements on one CUDA GPU: every chapter's, in one run of a few minutes.

    make gpu-bench                           # HF_HUB_OFFLINE=1 python -m minivllm.bench.gpu
    python -m minivllm.bench.gpu --out DIR   # write somewhere else than figures/gpu/
    python -m minivllm.bench.gpu --quick     # tiny sizes, any device: checks that it runs
    python -m minivllm.bench.gpu --chapters smoke,06,11   # only those chapters

scripts/gpu_bench.py takes the same arguments.

The notebooks measure on the machine they run on (a 2-core CPU for the committed outputs). This
package measures what each chapter measures on a GPU, with the embedded SmolLM2-135M-Instruct in
float32 (the dtype in which our tokens equal transformers'), the engines that a chapter times
also in bfloat16 beside it (for speed: their tokens may differ), and everything it runs comes
from the rest of minivllm (`run_benchmark`, the shared workloads, the chapters' modules); nothing
in minivllm imports it. One module per chapter, in the order they run:

    smoke.py                     the CUDA smoke, first: every CUDA-specific branch once (Triton
                                 kernels against the torch reference, flex without falling
                                 back, bfloat16, CUDA graphs against eager tokens, with 2+ GPUs
                                 NCCL and TP/DP engines each rank on its own GPU), each "ok",
                                 "skipped: <why>" or "error: <message>"
    ch00_logits.py               our logits against transformers' on chat prompts of 20-1000
                                 tokens: the largest difference per prompt, a histogram of all
    ch01_naive_cost.py           one no-cache step (a forward pass over the whole sequence)
                                 against the sequence length; the no-cache loop against
                                 transformers' `generate`
    ch01b_sampler_cost.py        the sampler's time per step on random logits over the model's
                                 vocabulary, per setting (greedy, temperature, top-k, top-p,
                                 min-p, penalties, a seed) and rows in the batch
    ch02_kv_cache.py             every method of chapters 01-02 side by side (speedup over the
                                 no-cache loop); one decode step against the rows in the batch;
                                 the memory a static batch reserves against what it needs
    ch03_memory_waste.py         the engine run step by step: KV memory holding tokens, in paged
                                 blocks against a contiguous reservation per request; paged
                                 decode attention against the block size
    ch04_throughput.py           static against continuous batching at equal seats, and against
                                 transformers' padded batches, on outputs of varied length
    ch05_prefix_cache.py         the engine with and without prefix caching on requests that
                                 share a long system prompt: time to first token, throughput,
                                 prompt tokens computed
    ch06_attention_kernels.py    the attention backends (torch reference, flex, Triton) on decode
                                 steps over batch x context and on a prefill chunk; the Triton
                                 decode kernel's memory bandwidth; the engine on each backend
    ch07_parallelism.py          with 2+ GPUs, the engine alone against data parallel (DP=2) and
                                 tensor parallel (TP=3: the model's heads need it) on chapter
                                 04's workload, and NCCL all-reduces between 2 GPUs; with one
                                 GPU, its decode step, matmul peak and memory bandwidth; on any
                                 device, the projected tensor-parallel decode step of this model
                                 and of a Llama-3-8B shape at TP = 1-8 over an NVLink ring
    ch08_speculative_decoding.py plain decoding against n-gram speculation (k = 3 and 5) and a
                                 layer-skip draft, greedy: copying and free-writing requests at
                                 batch 1 (speedup, equal tokens, acceptance per draft position),
                                 then the copying requests at batch 1-64, plain against k = 3
    ch09_serving.py              `minivllm serve` under Poisson arrivals at a few request rates,
                                 fresh prompts at each: TTFT, TPOT and ITL at p50/p90/p99 against
                                 the throughput achieved
    ch10_structured_outputs.py   the same chat requests answered freely and under a JSON schema
                                 (xgrammar's bitmask per sampled row): output tokens/s of each
                                 and the schema's compile time
    ch11_compiled_step.py        the engine eager against compiled with CUDA graphs (its default
                                 on a GPU): one request decoding alone (batch 1, where launch
                                 overhead is the whole step) and the varied-output workload
    ch12_quantization.py         the weights in float32, bfloat16, int8, int4 and the GGUF file's
                                 Q4_1 blocks: batch 1 and 32 against each scheme's bandwidth
                                 bound, the bytes the weights hold, the kernel that ran

common.py holds what they share (the sizes, the run, a chapter's record and how it is saved),
main.py the run and the command line; each module's docstring says which notebook it feeds,
and each `measure_*` function's the fields of its JSON.

Each chapter writes two files under OUT/<device>/ (OUT is figures/gpu by default, <device> the
GPU's name as a slug): NN-name.json and NN-name.png, e.g. figures/gpu/nvidia-h200/04-throughput;
the smoke writes smoke.json alone. Each chapter runs in isolation: one that raises writes
NN.error.json (its error and traceback) instead of its files, and the others still run; a smoke
branch that fails is recorded in smoke.json and the smoke counts as failed; the run then exits
with status 1 naming the chapters that failed. The JSON is `write_json`'s record, the same as
`minivllm bench` writes: "workload" (name, description), "device", "results" (one entry per
method `run_benchmark` timed: every `MethodResult` field and output_tokens_per_s; empty where a
chapter times no such methods), and then "chapter" (null for the smoke), "model", "dtype",
"quick", "seconds" (wall time of the chapter) and the chapter's own measurements. Each
notebook's GPU section globs figures/gpu/*/NN-*.json (minivllm.bench.gpu_results), skips files
whose "quick" is true, and plots what it finds next to its own CPU numbers; without such a file
the section says so and moves on.

On a CPU the full sizes would take hours, and the notebooks' full mode already measures a CPU,
so without --quick the run refuses to start there. --quick runs every chapter at tiny sizes on
a tiny random model (two layers, the embedded tokenizer), in a few minutes on a 2-core CPU, and
writes to a temporary directory unless --out is given: the tests run it so that it cannot rot.
Its numbers check the plumbing, they measure nothing; it leaves out some bfloat16 engines
(those that would add an engine start or a compile of their own).
"""
