"""scripts/gpu_bench.py in quick mode: every chapter writes its JSON and its figure, and the
numbers in them are sane. `make gpu-bench` runs the same code at full size on a GPU; this run
(a tiny random model, tiny workloads, on whatever device there is) keeps it from rotting.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_bench.py"
STEMS = [
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
    "10-structured-outputs",
    "11-compiled-step",
]


def load_script():
    """The script as a module (scripts/ is not a package). It is registered in sys.modules
    first, as an import would: its dataclasses look their module up there."""
    if "gpu_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
        sys.modules["gpu_bench"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["gpu_bench"])
    return sys.modules["gpu_bench"]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    """Run the script once in quick mode; chapter stem -> its JSON record."""
    out_dir = load_script().main(["--quick", "--out", str(tmp_path_factory.mktemp("gpu"))])
    for stem in STEMS:
        assert (out_dir / f"{stem}.png").stat().st_size > 10_000, f"{stem}.png is missing or empty"
    return {stem: json.loads((out_dir / f"{stem}.json").read_text()) for stem in STEMS}


def by_method(record: dict) -> dict[str, dict]:
    return {result["method"]: result for result in record["results"]}


def test_every_chapter_writes_the_common_fields(records):
    for stem, record in records.items():
        assert record["chapter"] == int(stem[:2]), stem
        assert record["quick"] is True and record["dtype"] == "float32"
        assert record["workload"]["name"] and record["workload"]["description"]
        assert record["device"] and record["model"] and record["seconds"] > 0
        for result in record["results"]:
            assert result["output_tokens_per_s"] > 0
            assert result["output_tokens"] > 0


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
    assert all(seconds > 0 for seconds in naive["step_seconds"])

    kv_cache = records["02-kv-cache"]
    methods = by_method(kv_cache)
    assert list(methods) == ["hf", "naive", "kv-cache", "static", "hf-static"]
    # Greedy float32: every method gives transformers' tokens.
    assert all(result["same_tokens_as_first"] == 1.0 for result in methods.values())
    assert all(seconds > 0 for seconds in kv_cache["decode_step_seconds"])
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
    off, on = prefix["results"]
    assert (off["method"], on["method"]) == ("engine-no-prefix-cache", "engine")
    assert on["same_tokens_as_first"] == 1.0
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"] == off["prompt_tokens"]
    assert prefix["prompt_tokens_computed"] == {
        "off": off["prompt_tokens_computed"],
        "on": on["prompt_tokens_computed"],
    }
    assert 0 < prefix["prefix_cache_hit_rate"] <= 1
    assert prefix["ttft_ratio"] > 0 and prefix["throughput_ratio"] > 0


def test_attention_backends_run_side_by_side_with_the_same_tokens(records):
    kernels = records["06-attention-kernels"]
    backends = kernels["backends"]
    assert backends[:2] == ["torch", "flex"]  # and "triton" where it runs (GPU, interpreter)
    methods = by_method(kernels)
    # The engine runs on every backend, but not on Triton's interpreter (far too slow).
    engine_backends = [name for name in backends if torch.cuda.is_available() or name != "triton"]
    assert list(methods) == [f"engine-no-prefix-cache:{name}" for name in engine_backends]
    assert all(result["same_tokens_as_first"] == 1.0 for result in methods.values())
    assert all(set(row["ms"]) == set(backends) for row in kernels["decode_attention"])
    assert all(ms > 0 for row in kernels["decode_attention"] for ms in row["ms"].values())
    assert set(kernels["prefill_attention"]["ms"]) == set(backends)
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
    assert all(row["measured_s"] > 0 for row in parallel["decode_steps"])
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
    assert {(row["workload"], row["method"]) for row in batch1} == {
        (workload, method)
        for workload in ("copying", "free writing")
        for method in ("plain", "ngram k=3", "ngram k=5", "layer skip 80% k=3")
    }
    # Greedy float32: the verification step keeps exactly the tokens plain decoding picks.
    assert all(row["same_tokens"] is True for row in batch1)
    assert all(row["tokens_per_s"] > 0 and row["speedup"] > 0 for row in batch1)
    assert all(row["speedup"] == 1 for row in batch1 if row["method"] == "plain")
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
        assert len(shares) == int(key.split("/")[0].split("k=")[1]), key
        assert all(0 <= share <= 1 for share in shares), key
        # A draft is kept only after every earlier one was.
        assert all(later <= earlier for earlier, later in zip(shares, shares[1:])), key
    sweep = speculative["batch_sweep"]
    assert [row["batch"] for row in sweep] == sorted(row["batch"] for row in sweep)
    for row in sweep:
        assert row["plain_tokens_per_s"] > 0 and row["speculative_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(
            row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        )


def test_sampler_cost_has_every_setting_at_every_batch(records):
    script = load_script()
    record = records["01b-sampler-cost"]
    measured = {(row["setting"], row["rows"]) for row in record["sampler_ms"]}
    assert measured == {
        (setting, rows)
        for setting in script.SAMPLER_SETTINGS
        for rows in script.QUICK_SIZES.sampler_batches
    }
    assert all(row["ms"] > 0 for row in record["sampler_ms"])
    assert record["vocab_size"] > 0


def test_structured_outputs_time_both_modes_on_the_same_requests(records):
    record = records["10-structured-outputs"]
    free, constrained = record["rows"]
    assert (free["mode"], constrained["mode"]) == ("free", "json schema")
    assert free["requests"] == constrained["requests"] > 0
    for row in (free, constrained):
        assert row["output_tokens"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
    assert record["ratio"] == pytest.approx(constrained["tokens_per_s"] / free["tokens_per_s"])
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


def test_a_failing_chapter_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    script = load_script()

    def broken(run):
        raise RuntimeError("a kernel that does not launch")

    monkeypatch.setitem(script.CHAPTERS, "04", broken)
    with pytest.raises(SystemExit, match=r"\['04'\] failed"):
        script.main(["--quick", "--chapters", "00,04,03", "--out", str(tmp_path)])
    (out_dir,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    error = json.loads((out_dir / "04.error.json").read_text())
    assert error["chapter"] == 4 and "a kernel that does not launch" in error["error"]
    assert "RuntimeError" in error["traceback"]
    for stem in ("00-logits", "03-memory-waste"):  # before and after the failure
        assert (out_dir / f"{stem}.json").exists() and (out_dir / f"{stem}.png").exists()
    assert not list(out_dir.glob("04-*"))


def test_unknown_chapters_are_refused_by_name():
    with pytest.raises(SystemExit, match="no chapter"):
        load_script().main(["--quick", "--chapters", "12"])


def test_all_reduce_ranks_of_the_nccl_measurement_run_on_gloo():
    """The NCCL measurement runs only with 2+ GPUs; its ranks' code runs here over gloo."""
    rows = load_script().all_reduce_between_processes("gloo", [256, 4096], repeats=3)
    assert [row["bytes"] for row in rows] == [1024, 16384]
    assert all(row["seconds"] > 0 for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_a_full_run_refuses_to_start_on_a_cpu(tmp_path):
    with pytest.raises(SystemExit, match="CUDA"):
        load_script().main(["--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
