"""The book's measurements on one CUDA GPU: every chapter's, in one run.

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
in minivllm imports it. One module per chapter, chNN_name.py, run in the order of
main.CHAPTERS after smoke.py (the CUDA smoke: every CUDA-specific branch once, each "ok",
"skipped: <why>" or "error: <message>"); each says in its docstring what it measures and which
notebook it feeds, and in its `measure_*` function's the fields of its JSON. common.py holds what
they share (the sizes, the run, its timing, a chapter's record and figure and how they are
saved, the helpers of two or more chapters), main.py the run and the command line.

Every timing goes through bench/measure.py: what is compared or repeated runs interleaved in
rounds after an untimed one (`Run.rounds`; engines on whole workloads in `engine_repeats`
rounds, `run_benchmark`'s or `Run.engine_rounds`), a record quotes the median and keeps the
rounds' {median, low, high} beside it (`common.quoted`: a key ending in "_spread"), and a ratio
is taken within each round; what happens once (a first compile, a chapter's duration) by its
stopwatch.

Each chapter writes OUT/<device>/NN-name.json (OUT is figures/gpu by default, <device> the GPU's
name as a slug: figures/gpu/nvidia-h200/04-throughput.json); the smoke writes smoke.json. The
JSON is `write_json`'s record, as `minivllm bench` writes it (workload, device, results: a
`MethodResult` per method `run_benchmark` timed), then "chapter" (null for the smoke), "model",
"dtype", "quick", "seconds" (the chapter's wall time) and the chapter's own numbers; the
notebooks read it back through minivllm.bench.gpu_results, quick runs left out. The plotting
lives in the notebooks: each one's section "On a GPU" draws its chapter's record, and a chapter
writes a figure, NN-name.png, only of what its notebook does not draw (chapters 01b, 02, 03 and
06-11; 00, 01, 04, 05 and 12 write none).
Each chapter runs in isolation: one that raises writes NN.error.json (its error and traceback)
instead, a failing smoke branch fails the smoke alone, and the others still run; the run then
exits with status 1 naming the chapters that failed.

On a CPU the full sizes would take hours, and the notebooks' full mode already measures a CPU,
so without --quick the run refuses to start there. --quick runs every chapter at tiny sizes on
a tiny random model (two layers, the embedded tokenizer), in a few minutes on a 2-core CPU, and
writes to a temporary directory unless --out is given: the tests run it so that it cannot rot.
Its numbers check the plumbing, they measure nothing; it leaves out some bfloat16 engines
(those that would add an engine start or a compile of their own).
"""
