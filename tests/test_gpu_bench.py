"""minivllm.bench.gpu in quick mode: the CUDA smoke and every chapter write their JSON (and the
chapters whose notebook leaves part of the record undrawn, a figure), and the numbers in them
are sane. `make gpu-bench` runs the same code
at full size on a GPU; this run (a tiny random model, tiny workloads, on whatever device there
is) keeps it from rotting.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from filelock import FileLock

from minivllm.bench.gpu import ch09_serving, common, main, smoke
from minivllm.bench.gpu.ch01b_sampler_cost import SAMPLER_SETTINGS
from minivllm.bench.gpu.common import QUICK_SIZES, all_reduce_between_processes
from minivllm.bench.measure import Spread, rate_spread, ratio_spread
from minivllm.models.loader import embedded_model_dir, load_tokenizer

CHAPTER_STEMS = [
    "00-logits",
    "01-cost-vs-length",
    "01b-sampler-cost",
    "02-kv-cache",
    "03-memory-waste",
    "04-throughput",
    "05-prefix-cache",
    "06-attention-kernels",
    "07-parallelism",
    "08-speculative-decoding",
    "09-serving",
    "10-structured-outputs",
    "11-compiled-step",
    "12-quantization",
]
STEMS = ["smoke", *CHAPTER_STEMS]
# The chapters that draw a figure: what their notebook's section "On a GPU" does not draw of the
# record. The other notebooks draw their whole record, and the smoke's record is its statuses.
FIGURE_STEMS = [
    "01b-sampler-cost",
    "02-kv-cache",
    "03-memory-waste",
    "06-attention-kernels",
    "07-parallelism",
    "08-speculative-decoding",
    "09-serving",
    "10-structured-outputs",
    "11-compiled-step",
]
# The smoke's branches that need a CUDA device; the others run on a CPU too.
CUDA_BRANCHES = {
    "triton_attention",
    "cuda_graphs_engine",
    "nccl_all_reduce",
    "tensor_parallel_engine",
    "data_parallel_engine",
}


@pytest.fixture(scope="module")
def records(tmp_path_factory, worker_id) -> dict[str, dict]:
    """Run the bench once in quick mode; stem -> its JSON record. Under pytest-xdist several
    workers may run this module's tests: the first to take the lock runs the bench into the
    session's folder (the parent of each worker's own), and the others read its files."""
    if worker_id == "master":  # no xdist: this process is the whole session
        out_dir = main.main(["--quick", "--out", str(tmp_path_factory.mktemp("gpu"))])
    else:
        session_dir = tmp_path_factory.getbasetemp().parent
        with FileLock(session_dir / "gpu-bench.lock"):
            done = session_dir / "gpu-bench.done"
            if done.exists():
                out_dir = Path(done.read_text())
            else:
                out_dir = main.main(["--quick", "--out", str(session_dir / "gpu-bench")])
                done.write_text(str(out_dir))
    assert sorted(path.stem for path in out_dir.glob("*.png")) == FIGURE_STEMS
    for stem in FIGURE_STEMS:
        assert (out_dir / f"{stem}.png").stat().st_size > 10_000, f"{stem}.png is empty"
    assert sorted(path.stem for path in out_dir.glob("*.json")) == sorted(STEMS)
    return {stem: json.loads((out_dir / f"{stem}.json").read_text()) for stem in STEMS}


def assert_spreads(medians: list[float], spreads: list[dict]) -> None:
    """Each median a record quotes has its rounds' {median, low, high} beside it."""
    assert len(medians) == len(spreads) > 0
    for median, spread in zip(medians, spreads):
        assert spread["median"] == pytest.approx(median)
        assert 0 < spread["low"] <= spread["median"] <= spread["high"]


def by_method(record: dict) -> dict[str, dict]:
    return {result["method"]: result for result in record["results"]}


def float32_rows(record: dict) -> list[dict]:
    """The results whose tokens are compared: bfloat16 rows ("...@bfloat16") are for speed."""
    return [result for result in record["results"] if result["dtype"] == "float32"]


def test_every_chapter_writes_the_common_fields(records):
    for stem, record in records.items():
        assert record["chapter"] == (None if stem == "smoke" else int(stem[:2])), stem
        assert record["quick"] is True and record["dtype"] == "float32"
        assert record["workload"]["name"] and record["workload"]["description"]
        assert record["device"] and record["model"] and record["seconds"] > 0
        for result in record["results"]:
            assert result["output_tokens_per_s"] > 0
            assert result["output_tokens"] > 0


def test_the_smoke_runs_every_branch_and_none_fails(records):
    record = records["smoke"]
    branches = record["branches"]
    assert list(branches) == list(smoke.BRANCHES)
    failed = {name: status for name, status in branches.items() if status != "ok"}
    assert all(status.startswith("skipped: ") for status in failed.values()), failed
    assert set(record["details"]) == {name for name, status in branches.items() if status == "ok"}
    assert record["tracebacks"] == {}
    assert record["num_gpus"] == torch.cuda.device_count()
    if not torch.cuda.is_available():
        assert failed == {name: "skipped: no CUDA device" for name in CUDA_BRANCHES}
    # What runs on any device ran, and checked what it says.
    for name in ("torch_engine", "bfloat16_engine"):
        assert record["details"][name]["output_tokens"] == 2 * QUICK_SIZES.smoke_output
    flex = record["details"]["flex_attention"]
    for diff in (flex["decode_max_abs_diff"], flex["prefill_max_abs_diff"]):
        assert 0 <= diff <= smoke.ATTENTION_TOLERANCE


def test_serving_latency_at_every_rate(records):
    record = records["09-serving"]
    rates = record["rates"]
    assert [row["request_rate"] for row in rates] == list(QUICK_SIZES.serve_rates)
    assert record["prefix_caching"] is False
    for row in rates:
        assert row["num_sent"] == QUICK_SIZES.serve_requests  # a tiny load: all sent in time
        assert 0 < row["num_completed"] <= row["num_sent"]
        assert row["num_failed"] == row["num_sent"] - row["num_completed"]
        assert row["output_throughput"] > 0 and row["request_throughput"] > 0
        for latency in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            p50, p90, p99 = (row[latency][p] for p in ("p50", "p90", "p99"))
            assert 0 < p50 <= p90 <= p99, (row["request_rate"], latency)
        # Per request the first token comes before the end, so every percentile does too.
        assert all(row["ttft_ms"][p] <= row["e2e_ms"][p] for p in ("p50", "p90", "p99"))
    assert math.isinf(rates[-1]["request_rate"])  # the last rate sends everything at once


def test_serving_sends_fresh_prompts_at_every_rate():
    """No rate's prompts are an earlier rate's: the prefix cache could not make a later rate
    cheaper even if it were on."""
    tokenizer = load_tokenizer(embedded_model_dir())
    run = SimpleNamespace(tokenizer=tokenizer, sizes=QUICK_SIZES)
    workload, per_rate = ch09_serving.fresh_prompts(run)
    assert [len(prompts) for prompts in per_rate] == [QUICK_SIZES.serve_requests] * len(
        QUICK_SIZES.serve_rates
    )
    every_prompt = [tuple(prompt) for prompts in per_rate for prompt in prompts]
    assert len(set(every_prompt)) == len(every_prompt) == workload.num_requests


def test_logits_equal_transformers(records):
    logits = records["00-logits"]
    assert logits["max_abs_diff"] < 1e-3 and logits["same_argmax"] is True
    assert len(logits["max_abs_diff_per_prompt"]) == len(logits["prompt_lengths"])
    histogram = logits["abs_diff_histogram"]
    assert len(histogram["log10_edges"]) == len(histogram["counts"]) + 1
    assert sum(histogram["counts"]) > 0


def test_naive_cost_and_kv_cache_methods_agree_with_transformers(records):
    naive = records["01-cost-vs-length"]
    assert list(by_method(naive)) == ["hf", "naive"]
    assert len(naive["step_seconds"]) == len(naive["step_lengths"])
    assert_spreads(naive["step_seconds"], naive["step_seconds_spread"])

    kv_cache = records["02-kv-cache"]
    methods = by_method(kv_cache)
    assert list(methods) == ["hf", "naive", "kv-cache", "static", "static@bfloat16", "hf-static"]
    assert methods["static@bfloat16"]["dtype"] == "bfloat16"
    assert methods["static@bfloat16"]["output_tokens"] == methods["static"]["output_tokens"]
    # Greedy float32: every method gives transformers' tokens.
    assert all(result["same_tokens_as_first"] == 1.0 for result in float32_rows(kv_cache))
    assert_spreads(kv_cache["decode_step_seconds"], kv_cache["decode_step_seconds_spread"])
    assert len(kv_cache["decode_step_seconds"]) == len(kv_cache["decode_rows"])
    static = kv_cache["static_batch"]
    assert static["reserved_kv_bytes"] >= static["needed_kv_bytes"] > 0
    assert 0 < static["useful_rows"] <= static["computed_rows"]


def test_memory_waste_paged_holds_more_tokens_than_a_max_length_reservation(records):
    memory = records["03-memory-waste"]
    share = memory["token_share"]
    assert 0 < share["contiguous_max"] < share["paged"] <= 1
    assert 0 < share["contiguous_final"] <= 1
    per_step = memory["per_step"]
    assert all(
        held <= slots for held, slots in zip(per_step["tokens_held"], per_step["paged_slots"])
    )
    assert len(memory["attention_seconds"]) == len(memory["attention_block_sizes"])
    assert_spreads(memory["attention_seconds"], memory["attention_seconds_spread"])


def test_throughput_runs_every_method_on_the_whole_workload(records):
    throughput = records["04-throughput"]
    seats = throughput["seats"]
    methods = by_method(throughput)
    assert list(methods) == [
        f"hf-static:{seats}",
        f"static:{seats}",
        "engine-no-prefix-cache",
        "engine-no-prefix-cache@bfloat16",
    ]
    assert len({result["output_tokens"] for result in methods.values()}) == 1
    assert methods["engine-no-prefix-cache@bfloat16"]["dtype"] == "bfloat16"


def test_prefix_cache_computes_fewer_prompt_tokens(records):
    prefix = records["05-prefix-cache"]
    off, on, off_bf16, on_bf16 = prefix["results"]
    assert [r["method"] for r in prefix["results"]] == [
        "engine-no-prefix-cache",
        "engine",
        "engine-no-prefix-cache@bfloat16",
        "engine@bfloat16",
    ]
    assert on["same_tokens_as_first"] == 1.0
    for without, with_cache in ((off, on), (off_bf16, on_bf16)):
        computed = with_cache["prompt_tokens_computed"]
        assert computed < without["prompt_tokens_computed"] == without["prompt_tokens"]
    assert {off_bf16["dtype"], on_bf16["dtype"]} == {"bfloat16"}
    assert prefix["prompt_tokens_computed"] == {
        "off": off["prompt_tokens_computed"],
        "on": on["prompt_tokens_computed"],
    }
    assert 0 < prefix["prefix_cache_hit_rate"] <= 1
    assert prefix["ttft_ratio"] > 0
    assert_spreads([prefix["throughput_ratio"]], [prefix["throughput_ratio_spread"]])


def test_attention_backends_run_side_by_side_with_the_same_tokens(records):
    kernels = records["06-attention-kernels"]
    backends = kernels["backends"]
    assert backends[:2] == ["torch", "flex"]  # and "triton" where it runs (GPU, interpreter)
    methods = by_method(kernels)
    # The engine runs on every backend, but not on Triton's interpreter (far too slow); in
    # bfloat16 too, but for flex's (a compile of its own) in a quick run.
    engine_backends = [name for name in backends if torch.cuda.is_available() or name != "triton"]
    assert list(methods) == [f"engine-no-prefix-cache:{name}" for name in engine_backends] + [
        f"engine-no-prefix-cache:{name}@bfloat16" for name in engine_backends if name != "flex"
    ]
    assert all(result["same_tokens_as_first"] == 1.0 for result in float32_rows(kernels))
    assert len({result["output_tokens"] for result in methods.values()}) == 1
    assert all(set(row["ms"]) == set(backends) for row in kernels["decode_attention"])
    for row in [*kernels["decode_attention"], kernels["prefill_attention"]]:
        assert set(row["ms"]) == set(row["ms_spread"]) == set(backends)
        assert_spreads(list(row["ms"].values()), list(row["ms_spread"].values()))
    assert (kernels["triton_decode_bandwidth"] is not None) == torch.cuda.is_available()


def test_parallel_engines_give_the_same_tokens(records):
    parallel = records["07-parallelism"]
    assert parallel["num_gpus"] == torch.cuda.device_count()
    methods = by_method(parallel)
    if parallel["skipped"]:  # one GPU: nothing to split over, no engine runs
        assert parallel["num_gpus"] == 1 and not methods
        return
    tp = parallel["tensor_parallel_size"]
    if not torch.cuda.is_available():
        assert tp == 2  # the quick model's 4 query / 2 KV heads split over 2 CPU ranks
    assert (tp is None) == (parallel["tensor_parallel_skipped"] is not None)
    assert list(methods) == ["engine", "engine:dp=2"] + ([f"engine:tp={tp}"] if tp else [])
    # Greedy float32: splitting the model or the requests does not change a token.
    assert all(result["same_tokens_as_first"] == 1.0 for result in methods.values())
    assert len({result["output_tokens"] for result in methods.values()}) == 1


def test_all_reduce_times_grow_with_the_message(records):
    parallel = records["07-parallelism"]
    rows, link = parallel["all_reduce"], parallel["link"]
    if not rows:  # one GPU: NCCL needs a GPU per rank
        assert parallel["num_gpus"] == 1 and link is None
        return
    assert parallel["all_reduce_backend"]
    sizes = [row["bytes"] for row in rows]
    assert sizes == sorted(sizes) and all(row["seconds"] > 0 for row in rows)
    assert rows[-1]["seconds"] > rows[0]["seconds"]  # thousands of times the bytes
    assert link["latency_s"] >= 0 and link["bandwidth"] > 0


def test_parallel_projection_divides_compute_and_adds_communication(records):
    parallel = records["07-parallelism"]
    assert parallel["machine"]["peak_flops"] > 0 and parallel["machine"]["bandwidth"] > 0
    steps = parallel["decode_steps"]
    assert_spreads([row["measured_s"] for row in steps], [row["measured_spread"] for row in steps])
    assert all(row["projected_s"] > 0 for row in parallel["decode_steps"])
    steps = {(row["model"], row["batch"], row["tp"]): row for row in parallel["projection"]}
    models = {model for model, _, _ in steps}
    assert models == {parallel["model"], "Llama-3-8B shape"}
    tp_sizes = {model: sorted({tp for m, _, tp in steps if m == model}) for model in models}
    assert tp_sizes["Llama-3-8B shape"] == [1, 2, 4, 8]
    assert tp_sizes[parallel["model"]][0] == 1
    for model, batch in {(model, batch) for model, batch, _ in steps}:
        rows = [steps[model, batch, tp] for tp in tp_sizes[model]]
        assert rows[0]["communication_s"] == 0 and rows[0]["speedup"] == 1
        assert all(row["communication_s"] > 0 for row in rows[1:])
        computes = [row["compute_s"] for row in rows]
        assert all(fewer < more for fewer, more in zip(computes[1:], computes))
        for row in rows:
            assert row["seconds"] == pytest.approx(row["compute_s"] + row["communication_s"])
            assert row["speedup"] == pytest.approx(rows[0]["seconds"] / row["seconds"])
    links = {link["tp"]: link for link in parallel["projection_links"]}
    assert set(links) == {tp for _, _, tp in steps} - {1}
    assert all(link["bandwidth"] > 0 and link["latency_s"] > 0 for link in links.values())


def test_speculative_decoding_keeps_greedy_tokens(records):
    speculative = records["08-speculative-decoding"]
    batch1 = speculative["batch1"]
    # bfloat16 engines (plain@bfloat16 and ngram k=3@bfloat16) run in a full run only.
    assert {(row["workload"], row["method"]) for row in batch1} == {
        (workload, method)
        for workload in ("copying", "free writing")
        for method in ("plain", "ngram k=3", "ngram k=5", "layer skip 80% k=3")
    }
    # Greedy float32: the verification step keeps exactly the tokens plain decoding picks.
    assert all(row["same_tokens"] is True for row in batch1)
    assert all(row["tokens_per_s"] > 0 and row["speedup"] > 0 for row in batch1)
    assert all(row["speedup"] == 1 for row in batch1 if row["method"] == "plain")
    # Rates and speedups are medians of rounds, each speedup's ratios taken within a round.
    assert_spreads([row["speedup"] for row in batch1], [row["speedup_spread"] for row in batch1])
    assert_spreads(
        [row["tokens_per_s"] for row in batch1], [row["tokens_per_s_spread"] for row in batch1]
    )
    acceptance = speculative["acceptance_per_position"]
    assert set(acceptance) == {
        f"{method}/{workload}"
        for method in ("ngram k=3", "ngram k=5", "layer skip 80% k=3")
        for workload in ("copying", "free writing")
    }
    assert set(speculative["verification_steps"]) == set(acceptance)
    assert all(steps >= 0 for steps in speculative["verification_steps"].values())
    # A draft model guesses at every step, even on the quick run's random model.
    assert all(
        steps > 0 for key, steps in speculative["verification_steps"].items() if "layer" in key
    )
    for key, shares in acceptance.items():
        setting = key.split("/")[0].partition("@")[0]  # "ngram k=3", "layer skip 80% k=3"
        assert len(shares) == int(setting.split("k=")[1]), key
        assert all(0 <= share <= 1 for share in shares), key
        # A draft is kept only after every earlier one was.
        assert all(later <= earlier for earlier, later in zip(shares, shares[1:])), key
    sweep = speculative["batch_sweep"]
    assert [row["batch"] for row in sweep] == sorted(row["batch"] for row in sweep)
    assert_spreads([row["ratio"] for row in sweep], [row["ratio_spread"] for row in sweep])
    for row in sweep:
        assert row["plain_tokens_per_s"] > 0 and row["speculative_tokens_per_s"] > 0
        # One round in a quick run: the ratio within it is the ratio of the two rates.
        assert row["ratio"] == pytest.approx(
            row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        )


def test_sampler_cost_has_every_setting_at_every_batch(records):
    record = records["01b-sampler-cost"]
    measured = {(row["setting"], row["rows"]) for row in record["sampler_ms"]}
    assert measured == {
        (setting, rows) for setting in SAMPLER_SETTINGS for rows in QUICK_SIZES.sampler_batches
    }
    rows = record["sampler_ms"]
    assert_spreads([row["ms"] for row in rows], [row["ms_spread"] for row in rows])
    assert record["vocab_size"] > 0


def test_structured_outputs_time_both_modes_on_the_same_requests(records):
    record = records["10-structured-outputs"]
    free, constrained = record["rows"]  # bfloat16's rows: a full run only
    assert (free["mode"], constrained["mode"]) == ("free", "json schema")
    assert free["requests"] == constrained["requests"] > 0
    for row in (free, constrained):
        assert row["output_tokens"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
        assert_spreads([row["seconds"]], [row["seconds_spread"]])
    assert record["ratio"] == pytest.approx(constrained["tokens_per_s"] / free["tokens_per_s"])
    assert_spreads([record["ratio"]], [record["ratio_spread"]])
    assert record["compile_seconds"] > 0


def test_compiled_step_gives_the_eager_tokens(records):
    """Chapter 11: compiled (with CUDA graphs on a GPU) against eager, at batch 1 and on the
    varied workload; float32 compiled gives the eager float32 tokens, and each speedup is the
    ratio of the rates recorded (the quick run measures float32 only)."""
    record = records["11-compiled-step"]
    for name, rows in (("varied", record["results"]), ("batch1", record["batch1"])):
        rate = {row["method"]: row for row in rows}
        eager, compiled = (rate[f"engine-no-prefix-cache:{s}"] for s in ("eager", "compiled"))
        assert compiled["same_tokens_as_first"] == 1.0 and compiled["matching_tokens"] == 1.0
        assert eager["output_tokens"] == compiled["output_tokens"] > 0
        speedup = record["speedups"][name]["float32"]
        assert speedup == pytest.approx(
            compiled["output_tokens_per_s"] / eager["output_tokens_per_s"]
        )
    assert record["batch1"][0]["num_requests"] == 1
    for name, speedups in record["speedups"].items():
        spreads = record["speedup_spreads"][name]
        assert set(speedups) == set(spreads) == {"float32"}
        assert_spreads(list(speedups.values()), list(spreads.values()))


def test_quantization_rates_ratios_and_bounds(records):
    """Chapter 12: the quick run times bfloat16 and int4@bfloat16 (no GGUF file beside the tiny
    model), at batch 1 and batched; each ratio is over bfloat16's rate, int4 weights hold fewer
    bytes, and the int4 layers name the kernel they ran."""
    record = records["12-quantization"]
    assert record["schemes"] == ["bfloat16", "int4"] and record["gguf_skipped"]
    methods = ["engine-no-prefix-cache@bfloat16", "engine-no-prefix-cache:int4@bfloat16"]
    batched = record["batched"]
    assert batched["workload"]["name"] and batched["batch_size"] > 1
    for name, rows in (("batch1", record["results"]), ("batched", batched["results"])):
        assert [row["method"] for row in rows] == methods
        assert {row["dtype"] for row in rows} == {"bfloat16"}
        bf16, int4 = rows
        assert bf16["output_tokens"] == int4["output_tokens"] > 0
        assert record["ratios"][name]["bfloat16"] == 1.0
        assert record["ratios"][name]["int4"] == pytest.approx(
            int4["output_tokens_per_s"] / bf16["output_tokens_per_s"]
        )
    assert record["results"][0]["num_requests"] == 1
    for name, ratios in record["ratios"].items():
        spreads = record["ratio_spreads"][name]
        assert list(ratios) == list(spreads) == record["schemes"]
        assert_spreads(list(ratios.values()), list(spreads.values()))
    weights = record["weight_bytes"]
    assert 0 < weights["int4"]["loaded"] < weights["bfloat16"]["loaded"]
    assert 0 < weights["int4"]["model"] < weights["bfloat16"]["model"]
    assert record["memory_bandwidth"] > 0
    assert len(record["bounds"]) == 2 * len(record["schemes"])
    for row in record["bounds"]:
        assert row["bound_tokens_per_s"] > 0 and row["share_of_bound"] > 0
    assert record["kernels"]["bfloat16"] == ["float"]
    assert record["int4_kernel"] in record["kernels"]["int4"]


def test_a_failing_chapter_or_smoke_branch_is_recorded_and_the_others_still_run(
    tmp_path, monkeypatch
):
    """A smoke branch that raises is recorded as "error: ..." among the others, and fails the
    smoke; a chapter that raises writes NN.error.json; the chapters after both still run."""

    def broken_chapter(run):
        raise RuntimeError("a kernel that does not launch")

    def broken_branch(_smoke):
        raise ValueError("no such device")

    def skipped_branch(_smoke):
        raise smoke.Skipped("needs 8 GPUs")

    branches = {"works": lambda _smoke: {"checked": 1}, "breaks": broken_branch}
    monkeypatch.setattr(smoke, "BRANCHES", branches | {"skips": skipped_branch})
    monkeypatch.setitem(main.CHAPTERS, "04", broken_chapter)
    with pytest.raises(SystemExit, match=r"\['smoke', '04'\] failed"):
        main.main(["--quick", "--chapters", "smoke,04,00", "--out", str(tmp_path)])
    (out_dir,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    record = json.loads((out_dir / "smoke.json").read_text())
    assert record["branches"] == {
        "works": "ok",
        "breaks": "error: ValueError: no such device",
        "skips": "skipped: needs 8 GPUs",
    }
    assert record["details"] == {"works": {"checked": 1}}
    assert (
        set(record["tracebacks"]) == {"breaks"}
        and "broken_branch" in record["tracebacks"]["breaks"]
    )
    error = json.loads((out_dir / "04.error.json").read_text())
    assert error["chapter"] == 4 and "a kernel that does not launch" in error["error"]
    assert "RuntimeError" in error["traceback"]
    assert (out_dir / "00-logits.json").exists()
    assert not list(out_dir.glob("04-*"))


def test_no_module_of_the_gpu_bench_reads_a_clock_of_its_own():
    """Every timing goes through bench/measure.py (through `Run.rounds`, `run_benchmark`, the
    bench helpers, or its stopwatch for a one-off): none times with a clock of its own."""
    package = Path(main.__file__).parent
    sources = {path.name: path.read_text() for path in package.glob("*.py")}
    assert "ch08_speculative_decoding.py" in sources and "common.py" in sources
    for name, source in sources.items():
        for clock in ("perf_counter", "time.time(", "monotonic", "import time", "best_time("):
            assert clock not in source, f"{name} times with {clock}"


def fake_run(**sizes) -> SimpleNamespace:
    """What `Run.rounds` and `Run.engine_rounds` use of a run: its sizes and device."""
    run = SimpleNamespace(sizes=replace(QUICK_SIZES, **sizes), device=torch.device("cpu"))
    run.rounds = partial(common.Run.rounds, run)
    return run


def test_rounds_interleave_the_methods_after_an_untimed_round():
    calls = []
    run = fake_run(repeats=2)
    timings = common.Run.rounds(
        run, {"a": partial(calls.append, "a"), "b": partial(calls.append, "b")}
    )
    assert calls == ["a", "b"] * 3  # one untimed round, then two timed, A B A B A B
    assert [len(timings.seconds[name]) for name in "ab"] == [2, 2]
    assert len(common.Run.sweep(run, {16: partial(calls.append, 16)})) == 1


@pytest.mark.parametrize(("engine_repeats", "calls"), [(1, 1), (3, 4)])
def test_engine_rounds_warm_up_only_when_repeated(engine_repeats, calls):
    """A quick run's whole workloads run once each, timed; a full run's get an untimed round
    first, as `run_benchmark` runs them."""
    made = []
    run = fake_run(engine_repeats=engine_repeats)
    timings = common.Run.engine_rounds(
        run, {"engine": partial(made.append, 1)}, prepare={"engine": partial(made.append, 0)}
    )
    assert made == [0, 1] * calls  # prepared, untimed, before every call
    assert len(timings.seconds["engine"]) == engine_repeats


def test_rates_and_ratios_are_taken_round_by_round():
    rates = rate_spread(10, Spread((1.0, 2.0)))
    assert rates.values == (10.0, 5.0)
    assert ratio_spread(rates, Spread((5.0, 5.0))).values == (2.0, 1.0)
    with pytest.raises(ValueError):  # rounds of different runs cannot pair
        ratio_spread(rates, Spread((5.0,)))
    record = dict(median=7500.0, low=5000.0, high=10000.0)
    assert common.spread_record(rates, 1e3) == record
    # A record quotes the median and keeps the rounds beside it, for one spread or a list.
    assert common.quoted("rate", rates, 1e3) == dict(rate=7500.0, rate_spread=record)
    assert common.quoted("rate", [rates], 1e3) == dict(rate=[7500.0], rate_spread=[record])


def test_unknown_chapters_are_refused_by_name():
    with pytest.raises(SystemExit, match="no chapter"):
        main.main(["--quick", "--chapters", "99"])


def test_all_reduce_ranks_of_the_nccl_measurement_run_on_gloo():
    """The NCCL measurement runs only with 2+ GPUs; its ranks' code runs here over gloo."""
    rows = all_reduce_between_processes("gloo", [256, 4096], repeats=3)
    assert [row["bytes"] for row in rows] == [1024, 16384]
    assert all(row["seconds"] > 0 for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_a_full_run_refuses_to_start_on_a_cpu(tmp_path):
    with pytest.raises(SystemExit, match="CUDA"):
        main.main(["--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
