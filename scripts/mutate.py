"""Mutation testing of the engine's core packages: how many small bugs do the tests catch?

    python scripts/mutate.py                 # every group, then mutation-scores.md
    python scripts/mutate.py spec_decode     # one group (the others keep their last scores)
    python scripts/mutate.py --retest core   # the mutants not killed or not run yet
    python scripts/mutate.py --report        # rewrite mutation-scores.md from the last runs

The tool is mutmut 3 (cosmic-ray was the other candidate). mutmut writes every mutant of a
file into one copy of it, behind a "trampoline" that picks the active mutant from an
environment variable, and it records which tests run each function; so a mutant costs one
fork and the few tests that reach it, with no rewrite or reimport of the package. cosmic-ray
rewrites the module for every mutant and runs the whole test command each time, which on a
two-core machine is hours more for the same count. mutmut also keeps its results between
runs: a rerun tests only the functions that changed.

Each group mutates its own modules against its own fast unit tests (GROUPS below), not the
whole suite: a mutant must be caught by the tests written for that code. mutmut reads its
settings from the pyproject.toml of the directory it runs in, so each group runs in a
directory of its own, build/mutate/<group>/, whose pyproject.toml holds that group's
[tool.mutmut] section next to the project's pytest settings; minivllm/ and tests/ are links
to the checkout's, which mutmut copies into build/mutate/<group>/mutants/.

mutmut keeps its verdicts in build/mutate/<group>/mutants/, which a fresh checkout does not
have. So after every run they are also written to mutation-verdicts.jsonl, which is committed:
one line per mutated function, with mutmut's hash of its code and its mutants' exit codes. A
run where build/ is missing starts from that file, and mutmut reruns only the functions whose
code changed since (their hash differs) and the mutants it had not run yet; the scores are
written from it.

The score of a module is killed / (mutants - equivalent): a mutant counts as killed when a
test failed, timed out or crashed with it, and as not killed when the tests passed
("survived") or none of the group's tests ran its function ("no tests"). An equivalent
mutant changes no behaviour at all (EQUIVALENT below says why for each), so no test can
kill it; it is left out of the count.

A few functions run only in a child process (the engine core's and a data-parallel replica's
process body): mutmut learns which tests reach a function by recording calls in the test
process, so it never links a test to them and reports their mutants as "no tests", although
the server and data-parallel tests run them in every child they start. CHILD_PROCESS_ONLY
names them; their mutants are listed apart and left out of the score, like the equivalent
ones. The loops those bodies run (EngineCoreProc, serve) are tested in the test process too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutate"
SCORES_MD = ROOT / "mutation-scores.md"
VERDICTS = ROOT / "mutation-verdicts.jsonl"
GOAL = 0.90

# group -> (modules to mutate, the tests that run against them). The tests are the fast unit
# tests of each package; the slow ones (a real model, a server, a notebook) are left out by
# `-m "not slow"` below.
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "spec_decode": (["minivllm/spec_decode/*.py"], ["tests/test_ch08_spec_decode.py"]),
    "structured_output": (
        ["minivllm/structured_output/*.py"],
        ["tests/test_ch10_structured_outputs.py"],
    ),
    "sample": (
        ["minivllm/sample/*.py"],
        ["tests/test_sampling.py", "tests/test_logit_bias_and_logprobs_mode.py"],
    ),
    "core": (
        ["minivllm/core/*.py"],
        [
            "tests/test_request.py",
            # The scheduler's own tests, with a stand-in runner (chapter 04's engine tests
            # run it with a model, minutes per mutant: the engine group has them).
            "tests/test_scheduler.py",
            "tests/test_ch03_paged.py",
            "tests/test_ch05_prefix_cache.py",
        ],
    ),
    "engine": (
        ["minivllm/engine/*.py"],
        [
            # The fast unit tests first: stand-in engines, sockets and processes, no model.
            "tests/test_engine_units.py",
            "tests/test_ch04_engine.py",
            "tests/test_engine_failures.py",
            "tests/test_engine_review_2.py",
            "tests/test_ch09_async_engine.py",
            "tests/test_ch07_data_parallel.py",  # engine/data_parallel.py is chapter 07's
        ],
    ),
    "quantization": (["minivllm/models/quantization.py"], ["tests/test_ch12_quantization.py"]),
}

# Mutants that change nothing a caller can observe, by mutmut's name -> why. They are listed
# in the score file and left out of the score. (A name holds while its function's code does.)
_ON_THE_CPU = (
    "device=self.device -> device=None: the same on the CPU, where the tests run (None is the"
    " CPU); on a GPU the tensor would be on the wrong device, which the GPU tests would catch"
)
_CPU_GENERATOR = (
    "the draw's device (the generator's, the CPU without one) -> the CPU or None (the CPU):"
    " the same for a CPU generator, the only kind where the tests run; a GPU generator would"
    " be refused there, which the GPU tests would catch"
)
_DEVICE = (
    "a device argument dropped or None (the CPU), or a .to() that no longer names the device:"
    " the same where the tests run, on the CPU; on a GPU the tensor would be on the wrong"
    " device, which the GPU tests would catch"
)
_SAME_AXIS = (
    "dim=-1 -> dim=+1 or no dim (the last by default), or shape[-1] -> shape[+1]: the same"
    " axis of the 2-D [rows, vocab] tensors these functions work on"
)
_MINUS_INF = 'float("-inf") -> float("-INF"): Python reads both as minus infinity'
_SAME_DTYPE = (
    "a .to() that no longer names the dtype: the sampler passes its per-row parameters as"
    " float32 (top_k as int64) already, made by _param_tensor, so nothing changes"
)
_INFERRED_DTYPE = (
    "_param_tensor's dtype dropped: torch infers float32 from SamplingParams' float fields"
    " (floats once validated) and int64 from top_k, the dtypes asked for"
)
_STRICT_ZIP = (
    "zip(strict=True) -> strict=False, None or left out: the lists zipped always have equal"
    " lengths, so the check never fires"
)
_LOW_INCLUSIVE = "low_inclusive=False -> None: both are false, the same bound (> 0)"
_IN_RANGE = (
    "a bound of the levels' clamp dropped: round(w / scale) is within them by construction"
    " (the largest |w| or the group's range is the scale times 127 or 15, rounding absorbs the"
    " last bit, and a replaced scale of 1 leaves only zeros)"
)
_INT64_SHIFTS = (
    "the shift amounts as int64 instead of int32: the int32 words are promoted to int64 with"
    " their sign, and bit j (the sign bit too) is read the same after a shift by j"
)
_PICKLE_PROTOCOL = (
    "pickle's protocol 5 -> the default protocol (None, or no argument): other bytes are"
    " hashed, but equal blocks still get equal names and different blocks different ones"
    " within a process; the protocol is pinned so that names do not change with Python's"
    " default"
)
_CORE_DP_SIZE = (
    "a core's or replica's config keeps data_parallel_size (or gets 2) instead of 1: it builds"
    " an LLMEngine directly, which never reads it (only make_engine and the clients do); the 1"
    " keeps its config truthful"
)
_NO_STEP_YET = (
    "the last step's prefix-cache lookups before any step, (0, 0) -> (1, 0) or (0, 1): only"
    " their rate is read (get_metrics), hits / queries or 0 without queries, 0.0 for all three"
)
_NOTHING_TO_LINGER = (
    "a socket of a core that failed to start closed with linger None (the default, forever)"
    " or 1 ms instead of 0: nothing was ever sent on it, so there is nothing to linger over"
    " and it closes at once either way"
)
_MODEL_AS_GIVEN = (
    "the cores or replicas get the model as given instead of its resolved path: each resolves"
    " it to the same directory; the front end resolves it first only so that they do not all"
    " convert the embedded model at once, which the conversion tolerates"
)
_REPLICA_DEVICE_ON_CPU = (
    "replica_device(config, None): on the CPU, where the tests run, it returns the config"
    " whatever the index; on GPUs None * tensor_parallel_size raises at start, which the GPU"
    " tests would catch"
)
_SOCKET_DIRECTORY = (
    "the socket directory's name prefix changed or dropped: mkdtemp makes a new private"
    " directory all the same, and the name is read by nobody"
)
_ONE_CORE_AFFINITY = (
    "prefix affinity kept with one core too: every request goes to the only core either way;"
    " the affinity only remembers blocks for nothing"
)
_SOCKET_NAMES = (
    'the name of a socket file changed ("in" -> "XXinXX", "IN", ...): any two different'
    " names work, since the core is given the same addresses the client binds"
)
_INHERITED_DAEMON = (
    "daemon=False -> None or left out: the process then inherits the daemon flag of the"
    " process that starts it, which is not a daemon (a daemon could not start the core)"
)
EQUIVALENT: dict[str, str] = {
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_34": _ON_THE_CPU,
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_39": (
        "device=self.device dropped from AttentionMetadata.build, whose default is the CPU: "
        + _ON_THE_CPU
    ),
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_50": _ON_THE_CPU,
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁ__init____mutmut_8": (
        "self.device = None: every tensor the draft makes is then on the CPU; " + _ON_THE_CPU
    ),
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_52": _ON_THE_CPU,
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_54": _ON_THE_CPU,
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_56": _ON_THE_CPU,
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_65": _ON_THE_CPU,
    "minivllm.spec_decode.draft_model_proposer.xǁDraftModelProposerǁforward__mutmut_67": _ON_THE_CPU,
    "minivllm.spec_decode.rejection_sampler.x_draw__mutmut_10": _CPU_GENERATOR,
    "minivllm.spec_decode.rejection_sampler.x_draw__mutmut_12": _CPU_GENERATOR,
    "minivllm.spec_decode.rejection_sampler.x_draw__mutmut_23": _CPU_GENERATOR,
    "minivllm.spec_decode.rejection_sampler.x_uniform__mutmut_1": _CPU_GENERATOR,
    "minivllm.spec_decode.rejection_sampler.x_uniform__mutmut_3": _CPU_GENERATOR,
    "minivllm.spec_decode.rejection_sampler.x_uniform__mutmut_10": _CPU_GENERATOR,
    "minivllm.spec_decode.rejection_sampler.x_uniform__mutmut_13": _CPU_GENERATOR,
    "minivllm.spec_decode.rejection_sampler.x_rejection_sample__mutmut_17": (
        "min(1.0, ratio) -> min(2.0, ratio): the draw it is compared with is below 1, so a"
        " ratio of 1 or more accepts either way"
    ),
    "minivllm.sample.sampler.x_make_generator__mutmut_4": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_7": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_14": _DEVICE,
    "minivllm.sample.sampler.x_apply_temperature__mutmut_5": _DEVICE,
    "minivllm.sample.sampler.x_apply_temperature__mutmut_7": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_20": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_22": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_27": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_29": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_34": _DEVICE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_36": _DEVICE,
    "minivllm.sample.sampler.x_apply_logit_bias__mutmut_9": _DEVICE,
    "minivllm.sample.sampler.x_apply_logit_bias__mutmut_11": _DEVICE,
    "minivllm.sample.sampler.x_apply_logit_bias__mutmut_13": _DEVICE,
    "minivllm.sample.sampler.x_apply_logit_bias__mutmut_15": _DEVICE,
    "minivllm.sample.sampler.x_apply_logit_bias__mutmut_23": _DEVICE,
    "minivllm.sample.sampler.x_apply_logit_bias__mutmut_25": _DEVICE,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_5": _DEVICE,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_7": _DEVICE,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_2": _DEVICE,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_4": _DEVICE,
    "minivllm.sample.sampler.x_apply_min_p__mutmut_8": _DEVICE,
    "minivllm.sample.sampler.x_apply_min_p__mutmut_10": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_penalise__mutmut_16": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_penalise__mutmut_26": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_penalise__mutmut_36": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_draw__mutmut_8": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_exponential_noise__mutmut_4": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_exponential_noise__mutmut_7": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_exponential_noise__mutmut_13": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_exponential_noise__mutmut_28": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_exponential_noise__mutmut_31": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_exponential_noise__mutmut_40": _DEVICE,
    "minivllm.sample.sampler.x__exponentials__mutmut_4": _DEVICE,
    "minivllm.sample.sampler.x__exponentials__mutmut_7": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_16": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_31": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_46": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_60": _DEVICE,
    "minivllm.sample.sampler.x__param_tensor__mutmut_3": _DEVICE,
    "minivllm.sample.sampler.x__param_tensor__mutmut_6": _DEVICE,
    "minivllm.sample.sampler.x__token_counts__mutmut_20": _DEVICE,
    "minivllm.sample.sampler.x__token_counts__mutmut_14": (
        "repeat_interleave(arange(n), lengths) -> repeat_interleave(lengths): the one-argument"
        " form is defined as exactly that (each index repeated its count of times)"
    ),
    "minivllm.sample.sampler.x_apply_penalties__mutmut_2": _SAME_AXIS,
    "minivllm.sample.sampler.x_ban_tokens__mutmut_20": _SAME_AXIS,
    "minivllm.sample.sampler.x_sanitize_logits__mutmut_16": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_2": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_18": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_20": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_14": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_17": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_23": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_31": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_min_p__mutmut_3": _SAME_AXIS,
    "minivllm.sample.sampler.x_apply_min_p__mutmut_17": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁ__call____mutmut_8": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁ_collect_logprobs__mutmut_22": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁ_draw__mutmut_3": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁ_draw__mutmut_12": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁ_draw__mutmut_18": _SAME_AXIS,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_2": _SAME_AXIS,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_26": _SAME_AXIS,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_33": _SAME_AXIS,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_35": _SAME_AXIS,
    "minivllm.sample.sampler.x__empty_rows__mutmut_2": _SAME_AXIS,
    "minivllm.sample.sampler.x_ban_tokens__mutmut_18": _MINUS_INF,
    "minivllm.sample.sampler.x_ban_tokens__mutmut_30": _MINUS_INF,
    "minivllm.sample.sampler.x_sanitize_logits__mutmut_9": _MINUS_INF,
    "minivllm.sample.sampler.x_sanitize_logits__mutmut_30": _MINUS_INF,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_49": _MINUS_INF,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_59": _MINUS_INF,
    "minivllm.sample.sampler.x_apply_temperature__mutmut_23": _MINUS_INF,
    "minivllm.sample.sampler.x_apply_min_p__mutmut_27": _MINUS_INF,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_21": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_temperature__mutmut_6": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_temperature__mutmut_8": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_23": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_28": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_30": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_35": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_37": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_6": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_top_k__mutmut_8": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_3": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_top_p__mutmut_5": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_min_p__mutmut_9": _SAME_DTYPE,
    "minivllm.sample.sampler.x_apply_min_p__mutmut_11": _SAME_DTYPE,
    "minivllm.sample.sampler.x__param_tensor__mutmut_2": _INFERRED_DTYPE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_15": _INFERRED_DTYPE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_30": _INFERRED_DTYPE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_45": _INFERRED_DTYPE,
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_59": _INFERRED_DTYPE,
    "minivllm.sample.sampler.x__param_tensor__mutmut_5": _INFERRED_DTYPE,
    "minivllm.sample.sampler.xǁSamplerǁ_penalise__mutmut_15": _INFERRED_DTYPE,
    "minivllm.sample.sampler.xǁSamplerǁ_penalise__mutmut_25": _INFERRED_DTYPE,
    "minivllm.sample.sampler.xǁSamplerǁ_penalise__mutmut_35": _INFERRED_DTYPE,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_48": _STRICT_ZIP,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_51": _STRICT_ZIP,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_52": _STRICT_ZIP,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_59": _STRICT_ZIP,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_66": _STRICT_ZIP,
    "minivllm.sample.sampler.x_rank_tokens__mutmut_69": _STRICT_ZIP,
    "minivllm.sample.sampler.x_apply_penalties__mutmut_52": "logits > 0 -> logits >= 0: a logit of 0 stays 0 whether divided or multiplied by the penalty",
    "minivllm.sample.sampler.x_apply_top_k__mutmut_13": "k < vocab -> k <= vocab: top-k with k = vocab keeps every token (none is below the smallest), as leaving the row alone does",
    "minivllm.sample.sampler.xǁSamplerǁ_exponential_noise__mutmut_12": "noise[i : i + 1] -> noise[i : i + 2]: the extra row written is the next one, which is written again afterwards (seeded rows in order, then the unseeded ones)",
    "minivllm.sample.sampler.xǁSamplerǁ__call____mutmut_41": "the pass that looks for rows with nothing to sample runs on an all-finite batch too: it finds none, the same errors; it is skipped only for speed",
    "minivllm.sample.sampler.xǁSamplerǁ_adjusted_logits__mutmut_21": "the fast path reports its logits as not all finite: the pass that looks for rows with nothing to sample then runs and finds none, the same errors",
    "minivllm.sample.sampler.xǁSamplerǁ_truncated_random_rows__mutmut_5": "adjusted[:0] -> adjusted[:1] where no row samples at random: the callers read the truncated rows only for the random rows, none here",
    "minivllm.sample.sampling_params.xǁSamplingParamsǁ_validate_sampling_knobs__mutmut_16": _LOW_INCLUSIVE,
    "minivllm.sample.sampling_params.xǁSamplingParamsǁ_validate_penalties__mutmut_33": _LOW_INCLUSIVE,
    "minivllm.sample.sampler.xǁSamplerǁprobabilities__mutmut_12": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁprobabilities__mutmut_14": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁprobabilities__mutmut_23": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁprobabilities__mutmut_33": _SAME_AXIS,
    "minivllm.sample.sampler.x_prompt_token_logprobs__mutmut_13": _SAME_AXIS,
    "minivllm.sample.sampler.xǁSamplerǁlogprobs__mutmut_13": _DEVICE,
    "minivllm.sample.sampler.xǁSamplerǁlogprobs__mutmut_15": _DEVICE,
    "minivllm.sample.sampler.x_prompt_token_logprobs__mutmut_3": _DEVICE,
    "minivllm.sample.sampler.x_prompt_token_logprobs__mutmut_5": _DEVICE,
    "minivllm.models.quantization.x_quantize_int8__mutmut_16": _IN_RANGE,
    "minivllm.models.quantization.x_quantize_int8__mutmut_17": _IN_RANGE,
    "minivllm.models.quantization.x_quantize_int8__mutmut_19": _IN_RANGE,
    "minivllm.models.quantization.x_quantize_int4__mutmut_32": _IN_RANGE,
    "minivllm.models.quantization.x_quantize_int4__mutmut_33": _IN_RANGE,
    "minivllm.models.quantization.x_quantize_int4__mutmut_35": _IN_RANGE,
    "minivllm.models.quantization.xǁInt8Weightǁrows__mutmut_3": (
        "q.to(scale's dtype) -> q.to(None), which keeps int8: int8 times the scale promotes to"
        " the scale's dtype anyway, and the levels are exact in it"
    ),
    "minivllm.models.quantization.xǁInt4Weightǁ__init____mutmut_47": (
        "inner_k_tiles 1 -> 2 for PyTorch's CPU packing, which does not read it (the packed"
        " tensors are equal); tinygemm's CUDA packing is the one that tiles K"
    ),
    "minivllm.core.kv_cache_manager.xǁKVCacheManagerǁfree_tail__mutmut_7": (
        "keep < len(table) -> keep <= len(table): with keep == len(table) there is no block past"
        " it, and freeing none changes nothing"
    ),
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_2": _SAME_AXIS,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_7": _DEVICE,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_10": _DEVICE,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_16": _DEVICE,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_26": _DEVICE,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_28": _DEVICE,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_37": _MINUS_INF,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_6": _INT64_SHIFTS,
    "minivllm.structured_output.manager.x_apply_token_bitmasks__mutmut_9": _INT64_SHIFTS,
    "minivllm.structured_output.manager.xǁCompiledGrammarCacheǁput__mutmut_2": (
        '_running[key] = None -> "": the dict is an ordered set, its values are never read'
    ),
    "minivllm.structured_output.manager.xǁStructuredOutputManagerǁshutdown__mutmut_1": (
        "shutdown(wait=False) -> wait=None: the executor reads it as a truth value, and None"
        " is false"
    ),
    "minivllm.structured_output.emptiness.x_matches_a_finite_string__mutmut_47": (
        "changed = False -> None: the loop reads it as a truth value only, and None is false"
    ),
    "minivllm.engine.output_processor.x_core_params__mutmut_3": (
        "stop=[] -> stop=None: replace() runs SamplingParams.__post_init__, which normalises"
        " None to [], the same value"
    ),
    # A delta holds one completion per sequence: LLMEngine._request_output lists all n.
    "minivllm.engine.output_processor.xǁOutputProcessorǁ_process__mutmut_4": _STRICT_ZIP,
    "minivllm.engine.output_processor.xǁOutputProcessorǁ_process__mutmut_7": _STRICT_ZIP,
    "minivllm.engine.output_processor.xǁOutputProcessorǁ_process__mutmut_8": _STRICT_ZIP,
    "minivllm.engine.output_processor.x_cumulative_logprob_after__mutmut_7": _STRICT_ZIP,
    "minivllm.engine.output_processor.x_cumulative_logprob_after__mutmut_10": _STRICT_ZIP,
    "minivllm.engine.output_processor.x_cumulative_logprob_after__mutmut_11": _STRICT_ZIP,
    "minivllm.engine.core_client.xǁInprocClientǁ__init____mutmut_7": (
        "_stopping = False -> None: it is read only as a truth value, and None is false"
    ),
    "minivllm.engine.async_llm.xǁAsyncLLMǁ__init____mutmut_14": (
        "_stopping = False -> None: it is read only as a truth value (is_running), and None is"
        " false"
    ),
    "minivllm.engine.async_llm.xǁRequestStreamǁ__anext____mutmut_6": (
        "unread = False -> None: it is read only as a truth value, and None is false"
    ),
    "minivllm.engine.core_client.xǁMPClientǁ_receive_outputs__mutmut_5": (
        "a core's output socket registered with the poller's default flags (POLLIN | POLLOUT)"
        " instead of POLLIN: a PULL socket cannot send, so it is never writable and only a"
        " message wakes the poll either way"
    ),
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_37": _NOTHING_TO_LINGER,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_38": _NOTHING_TO_LINGER,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_39": _NOTHING_TO_LINGER,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_40": _NOTHING_TO_LINGER,
    "minivllm.engine.core_client.x_wait_until_ready__mutmut_5": (
        "the wait between two looks at a starting core's process, 100 -> 101 ms: the same"
        " checks, one millisecond later at most"
    ),
    "minivllm.engine.core_client.x_wait_until_ready__mutmut_7": (
        "time > deadline -> time >= deadline: the two differ only at the one instant equal to"
        " the deadline (STARTUP_TIMEOUT_S after the start), and then only by one more poll of"
        " 100 ms"
    ),
    "minivllm.engine.core_client.xǁMPClientǁ_receive_outputs__mutmut_9": (
        "a core's sentinel registered with the poller's default flags (POLLIN | POLLOUT) instead"
        " of POLLIN: a process sentinel is the read end of a pipe, which is never writable, so"
        " only its end of file wakes the poll either way"
    ),
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_77": _NO_STEP_YET,
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_78": _NO_STEP_YET,
    "minivllm.engine.llm_engine.xǁLLMEngineǁstep__mutmut_7": (
        "an empty step's runner output None instead of an empty one: update_from_output reads"
        " it only for the requests scheduled, and an empty step schedules none"
    ),
    "minivllm.engine.llm_engine.xǁLLMEngineǁstep__mutmut_20": (
        'parent_ids[...] = None -> "": the dict is an ordered set, its values are never read'
    ),
    "minivllm.engine.core_client.xǁInprocClientǁ_run__mutmut_4": (
        "the thread steps the core even without work: EngineCore.step steps the engine only"
        " when it has unfinished requests, and an empty report is not sent"
    ),
    "minivllm.engine.data_parallel.xǁDataParallelEngineǁ__init____mutmut_10": _MODEL_AS_GIVEN,
    "minivllm.engine.data_parallel.xǁDataParallelEngineǁ__init____mutmut_11": _CORE_DP_SIZE,
    "minivllm.engine.data_parallel.xǁDataParallelEngineǁ__init____mutmut_13": _CORE_DP_SIZE,
    "minivllm.engine.data_parallel.xǁDataParallelEngineǁ__init____mutmut_34": _REPLICA_DEVICE_ON_CPU,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_8": _MODEL_AS_GIVEN,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_9": _CORE_DP_SIZE,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_11": _CORE_DP_SIZE,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_18": _SOCKET_DIRECTORY,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_19": _SOCKET_DIRECTORY,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_20": _SOCKET_DIRECTORY,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_38": _REPLICA_DEVICE_ON_CPU,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_59": _ONE_CORE_AFFINITY,
    "minivllm.engine.core_client.xǁMPClientǁ__init____mutmut_61": _ONE_CORE_AFFINITY,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_2": _SOCKET_NAMES,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_3": _SOCKET_NAMES,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_4": _SOCKET_NAMES,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_5": _SOCKET_NAMES,
    "minivllm.engine.data_parallel.x_start_replica__mutmut_10": _INHERITED_DAEMON,
    "minivllm.engine.data_parallel.x_start_replica__mutmut_14": _INHERITED_DAEMON,
    "minivllm.engine.data_parallel.xǁDataParallelEngineǁ__init____mutmut_54": (
        "PrefixAffinity(None) instead of the block size: the affinity keeps the value but nothing"
        " reads it (the engine hashes prompts with its config's block size itself)"
    ),
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_28": _INHERITED_DAEMON,
    "minivllm.engine.core_client.xǁMPClientǁ_start_core__mutmut_32": _INHERITED_DAEMON,
    "minivllm.engine.deltas.xǁOutputDeltasǁ_delta__mutmut_2": (
        "a new completion's tokens sent start at None instead of 0: a slice from None is a"
        " slice from 0"
    ),
    "minivllm.core.scheduler.xǁSchedulerǁschedule__mutmut_109": (
        "admitted.append(request) -> append(None): the list is only counted (len), and None"
        " counts as one"
    ),
    "minivllm.core.scheduler.xǁSchedulerǁschedule__mutmut_124": (
        "check_invariants(num_admitted=None): the rule 'no admission in a step that preempted'"
        " is then never checked, but schedule() keeps it by construction (its admission loop"
        " stops at the first preemption), so the check never fires either way"
    ),
    "minivllm.core.scheduler.xǁSchedulerǁupdate_from_output__mutmut_32": (
        "continue -> break after a prefill chunk that stops mid-prompt: such a chunk is always"
        " the last grant of its step (a grant stops short of a request's end only when it"
        " takes the whole remaining budget), so no request is left after it"
    ),
    "minivllm.core.kv_cache_manager.xǁBlockPoolǁallocate__mutmut_6": (
        "popitem(last=False) -> last=None: OrderedDict reads it as a truth value, and None is"
        " false (the head of the queue either way)"
    ),
    "minivllm.core.kv_cache_manager.xǁBlockPoolǁallocate__mutmut_14": (
        "touched[block] = 1 -> 2: the mark is only read as a truth value"
    ),
    "minivllm.core.kv_cache_manager.xǁBlockPoolǁfree__mutmut_9": (
        'free_queue[block] = None -> "": the queue is an ordered set, its values are never read'
    ),
    "minivllm.core.prefix_cache.x_hash_block__mutmut_3": _PICKLE_PROTOCOL,
    "minivllm.core.prefix_cache.x_hash_block__mutmut_5": _PICKLE_PROTOCOL,
    "minivllm.core.prefix_cache.xǁPrefixCacheǁcache_full_blocks__mutmut_8": (
        "num_full <= len(hashes) -> <: with as many hashes as full blocks the function goes"
        " on, hashes no block and names none (both ranges are empty)"
    ),
    "minivllm.core.prefix_cache.xǁPrefixCacheǁcache_full_blocks__mutmut_36": (
        "range(first_new, num_full) -> range(num_full): the blocks named at earlier steps are"
        " inserted again, which insert() ignores (it keeps the first name)"
    ),
    "minivllm.core.scheduler.xǁSpecDecodeStatsǁrecord__mutmut_8": (
        "len < num_draft_tokens -> len <= num_draft_tokens: at equal lengths the list grows by"
        " [0] * 0, nothing"
    ),
}

# Survivors with the reason they live: tests outside the group that kill them (checked by
# hand, the mutant written into the source), or the test still to write. They still count as
# survivors: the score says what the group's own tests catch.
_TENSOR_PARALLEL = (
    "the tensor-parallel path of LLMEngine.__init__: tests/test_ch07_tensor_parallel.py kills it"
    " (test_tp2_preempts_and_recomputes_like_tp1, test_bad_sizes_are_refused_before_any_process_"
    "starts); chapter 07's tensor-parallel tests start worker processes and are not in the"
    " engine group's list"
)
SURVIVORS_EXPLAINED: dict[str, str] = {
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_9": _TENSOR_PARALLEL,
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_10": _TENSOR_PARALLEL,
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_11": _TENSOR_PARALLEL,
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_12": _TENSOR_PARALLEL,
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_13": _TENSOR_PARALLEL,
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_14": _TENSOR_PARALLEL,
    "minivllm.engine.llm_engine.xǁLLMEngineǁ__init____mutmut_15": _TENSOR_PARALLEL,
}

# Functions that run only in a child process, by the prefix of their mutants' names -> why.
CHILD_PROCESS_ONLY: dict[str, str] = {
    "minivllm.engine.core.x_run_engine_core__mutmut_": (
        "the engine-core process's body (sockets, Ready, the loop, Failed on an error)"
    ),
    "minivllm.engine.core.x_exit_when_parent_dies__mutmut_": (
        "the engine-core process's watch on its parent (a thread that ends the process)"
    ),
    "minivllm.engine.data_parallel.x_run_replica__mutmut_": "a replica process's body",
    "minivllm.engine.data_parallel.x_start_inbox__mutmut_": "a replica's receiving thread",
    "minivllm.engine.data_parallel.x_serve__mutmut_": "a replica's loop",
    "minivllm.engine.data_parallel.x_drain__mutmut_": "a replica's inbox, read between steps",
    "minivllm.engine.data_parallel.x_report_failure__mutmut_": "a replica's last message",
}


def child_process_only(name: str) -> bool:
    return any(name.startswith(prefix) for prefix in CHILD_PROCESS_ONLY)


# mutmut's exit codes (mutmut/stats.py): a failing test (1), pytest's internal error (3), a
# timeout (SIGXCPU: 24, -24, 152, 255, or 36) or a crash (-11, -9) all kill the mutant.
KILLED_CODES = {1, 3, 24, -24, 152, 255, 36, -11, -9}
NO_TESTS_CODES = {5, 33}


def test_environment(group: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        MINIVLLM_QUICK="1",
        MINIVLLM_ENFORCE_EAGER="1",
        # One worker and one thread: mutants run one after another, each on a single core.
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        MKL_NUM_THREADS="1",
        # Tiny models are made once and copied, not made again for every mutant.
        PYTEST_PLUGINS="mutate_plugin",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "scripts"), env.get("PYTHONPATH")])),
        # The C++ kernels built from the group's copy of the sources, apart: torch rebuilds a
        # kernel whenever it is loaded from sources at another path, under a lock, so tests of
        # the checkout run meanwhile would make the mutants wait (and time out) for rebuilds.
        TORCH_EXTENSIONS_DIR=str(WORK / group / "torch_extensions"),
    )
    return env


def toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def prepare(group: str) -> Path:
    """build/mutate/<group>/ with the group's pyproject.toml and links to the sources."""
    modules, tests = GROUPS[group]
    workdir = WORK / group
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("minivllm", "tests"):
        link = workdir / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name)
    # The project's own pyproject.toml (pytest's settings and markers), then the group's
    # [tool.mutmut] section: the checkout's file has none.
    (workdir / "pyproject.toml").write_text(
        (ROOT / "pyproject.toml").read_text() + "\n"
        f"# Added by scripts/mutate.py for the group {group}.\n"
        "[tool.mutmut]\n"
        'source_paths = ["minivllm"]\n'
        f"only_mutate = {toml_list(modules)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        # No test that needs the embedded model or a server: those are minutes, not seconds.
        'pytest_add_cli_args = ["-m", "not slow", "-p", "no:cacheprovider"]\n'
        # The mutants' results depend on the sources and the tests only, not on git's state.
        "use_git_change_detection = false\n"
        # A mutant that loops for ever is stopped after 6 times its tests' CPU time, plus two
        # minutes (mutmut's defaults give it 30 times, close to an hour for the slow groups).
        # mutmut's estimate counts the tests' calls but not their fixtures, hence the margin:
        # a mutant must not count as killed only because the fixtures took long.
        "timeout_multiplier = 3.0\n"
        "timeout_constant = 20.0\n"
    )
    restore_verdicts(group, workdir)
    sync_verdicts(group)
    return workdir


def not_killed(group: str) -> list[str]:
    return [
        name
        for codes in module_results(group).values()
        for name, code in codes.items()
        if code not in KILLED_CODES and name not in EQUIVALENT and not child_process_only(name)
    ]


def run_group(group: str, retest: bool = False, jobs: int = 1) -> int:
    workdir = prepare(group)
    mutmut = Path(sys.executable).parent / "mutmut"
    # One mutant at a time by default (the machine may be shared); each runs on one thread, as
    # the environment says, so --jobs up to the number of cores runs that many side by side.
    command = [str(mutmut), "run", "--max-children", str(jobs)]
    if retest:
        # mutmut keeps a survivor's verdict until it is named again (new tests do not reset
        # it): name every mutant not killed yet. With none to name, the plain run still runs
        # the mutants of functions changed since their verdicts (mutmut compares their hashes).
        command += not_killed(group)
    print(f"== {group}: {' '.join(command)} (in {workdir.relative_to(ROOT)})", flush=True)
    status = subprocess.call(command, cwd=workdir, env=test_environment(group))
    sync_verdicts(group)
    return status


def module_dotted_name(module: str) -> str:
    """minivllm/engine/core.py -> minivllm.engine.core, as mutmut names a module's mutants."""
    return module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def local_verdicts(group: str) -> list[dict]:
    """mutmut's files of the group's last run here, one line per mutated function: its
    module, its name, the hash of its code and the exit code of each of its mutants
    (mutant i's at i - 1; None where it has not run)."""
    lines = []
    mutants = WORK / group / "mutants"
    for meta_file in sorted(mutants.rglob("*.py.meta")):
        module = str(meta_file.relative_to(mutants)).removesuffix(".meta")
        meta = json.loads(meta_file.read_text())
        hashes = meta["hash_by_function_name"]
        prefix = module_dotted_name(module) + "."
        codes_by_function: dict[str, list[int | None]] = {function: [] for function in hashes}
        for name, exit_code in meta["exit_code_by_key"].items():
            function, _, number = name.removeprefix(prefix).rpartition("__mutmut_")
            codes = codes_by_function.setdefault(function, [])
            codes += [None] * (int(number) - len(codes))
            codes[int(number) - 1] = exit_code
        lines += [
            dict(
                group=group,
                module=module,
                function=function,
                hash=hashes.get(function),
                exit_codes=codes,
            )
            for function, codes in sorted(codes_by_function.items())
        ]
    return lines


def mutmut_meta(exit_codes: dict[str, int | None], hashes: dict[str, str]) -> dict:
    """mutmut's file of one module's verdicts (mutants/<module>.meta); the durations it also
    keeps are estimates, made again by the next run."""
    return dict(
        exit_code_by_key=exit_codes,
        hash_by_function_name=hashes,
        type_check_error_by_key={},
        durations_by_key={},
        estimated_durations_by_key={},
    )


def mutants_of(line: dict) -> dict[str, int | None]:
    """A verdict line's mutants, by mutmut's name -> exit code."""
    prefix = f"{module_dotted_name(line['module'])}.{line['function']}__mutmut_"
    return {f"{prefix}{number}": code for number, code in enumerate(line["exit_codes"], start=1)}


def saved_verdicts() -> list[dict]:
    if not VERDICTS.exists():
        return []
    return [json.loads(line) for line in VERDICTS.read_text().splitlines()]


def group_verdicts(group: str) -> list[dict]:
    return [line for line in saved_verdicts() if line["group"] == group]


def save_verdicts(group: str, lines: list[dict]) -> None:
    """Replace the group's lines of mutation-verdicts.jsonl with these."""
    kept = [line for line in saved_verdicts() if line["group"] != group]
    ordered = sorted(
        kept + lines, key=lambda line: (line["group"], line["module"], line["function"])
    )
    VERDICTS.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in ordered))


def restore_verdicts(group: str, workdir: Path) -> None:
    """Write mutmut's files from mutation-verdicts.jsonl where this checkout has none."""
    hashes: dict[str, dict[str, str]] = {}
    for line in group_verdicts(group):
        if line["hash"] is not None:
            hashes.setdefault(line["module"], {})[line["function"]] = line["hash"]
    for module, exit_codes in module_results(group).items():
        meta_file = workdir / "mutants" / f"{module}.meta"
        if not meta_file.exists():
            meta_file.parent.mkdir(parents=True, exist_ok=True)
            meta = mutmut_meta(exit_codes, hashes.get(module, {}))
            meta_file.write_text(json.dumps(meta, ensure_ascii=False, indent=1))


def sync_verdicts(group: str) -> None:
    """mutation-verdicts.jsonl brought up to date with the group's run here, if any."""
    if (WORK / group / "mutants").is_dir():
        save_verdicts(group, local_verdicts(group))


def module_results(group: str) -> dict[str, dict[str, int | None]]:
    """module path -> mutant name -> exit code, from mutation-verdicts.jsonl."""
    results: dict[str, dict[str, int | None]] = {}
    for line in group_verdicts(group):
        results.setdefault(line["module"], {}).update(mutants_of(line))
    return results


def score_rows() -> list[dict]:
    rows = []
    for group in GROUPS:
        for module, codes in module_results(group).items():
            if not codes:  # nothing to mutate (an __init__.py, dataclasses only)
                continue
            equivalent = [m for m in codes if m in EQUIVALENT]
            in_child = [m for m in codes if child_process_only(m) and m not in EQUIVALENT]
            measured = {m: c for m, c in codes.items() if m not in equivalent + in_child}
            killed = [m for m, c in measured.items() if c in KILLED_CODES]
            not_run = [m for m, c in measured.items() if c is None]
            # The rest: the tests passed, none ran it, or its run was cut short ("suspicious").
            left = set(measured) - set(killed) - set(not_run)
            survived = [m for m in left if codes[m] not in NO_TESTS_CODES]
            no_tests = [m for m in left if codes[m] in NO_TESTS_CODES]
            counted = len(measured)
            rows.append(
                dict(
                    group=group,
                    module=module,
                    mutants=len(codes),
                    killed=len(killed),
                    survived=sorted(survived),
                    no_tests=sorted(no_tests),
                    not_run=sorted(not_run),
                    equivalent=sorted(equivalent),
                    in_child=sorted(in_child),
                    score=len(killed) / counted if counted else 1.0,
                )
            )
    return rows


def report_text(rows: list[dict]) -> str:
    """mutation-scores.md, from the rows of score_rows()."""
    lines = [
        "# Mutation scores",
        "",
        "Written by `make mutate` (scripts/mutate.py, mutmut 3): each module's mutants against",
        "the fast unit tests of its group. Score = killed / (mutants - equivalent - child",
        f"process only); the goal is {GOAL:.0%} for every module. A module with mutants not run",
        "yet has a partial score.",
        "",
        "| group | module | mutants | killed | survived | no tests | not run yet | equivalent"
        " | child process only | score |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = "" if r["score"] >= GOAL else " (below goal)"
        lines.append(
            f"| {r['group']} | `{r['module']}` | {r['mutants']} | {r['killed']} |"
            f" {len(r['survived'])} | {len(r['no_tests'])} | {len(r['not_run'])} |"
            f" {len(r['equivalent'])} | {len(r['in_child'])} |"
            f" {r['score']:.1%}{mark} |"
        )
    lines += ["", "## Mutants not killed", ""]
    for r in rows:
        left = r["survived"] + r["no_tests"]
        if not left:
            continue
        lines.append(f"- `{r['module']}`: " + ", ".join(f"`{m}`" for m in left))
    explained = [f"- `{name}`: {why}" for name, why in sorted(SURVIVORS_EXPLAINED.items())]
    if explained:
        lines += ["", "Survivors, explained (still counted as survivors):", ""]
        lines += explained
    lines += ["", "## Functions that run only in a child process", ""]
    lines += [f"- `{prefix}*`: {why}" for prefix, why in CHILD_PROCESS_ONLY.items()]
    if EQUIVALENT:
        lines += ["", "## Equivalent mutants", ""]
        lines += [f"- `{name}`: {why}" for name, why in sorted(EQUIVALENT.items())]
    lines += [
        "",
        "`cd build/mutate/<group> && ../../../.venv/bin/mutmut show <mutant>` prints a mutant's",
        "diff.",
        "",
    ]
    return "\n".join(lines)


def write_report() -> None:
    for group in GROUPS:
        sync_verdicts(group)
    rows = score_rows()
    SCORES_MD.write_text(report_text(rows))
    for r in rows:
        print(f"{r['score']:7.1%}  {r['module']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="*", help=f"default: all of {', '.join(GROUPS)}")
    parser.add_argument("--report", action="store_true", help="only rewrite the score files")
    parser.add_argument("--clean", action="store_true", help="forget the results of past runs")
    parser.add_argument(
        "--retest",
        action="store_true",
        help="run again the mutants not killed (after new tests), and those not run yet",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="mutants run side by side (each on one core)"
    )
    args = parser.parse_args()
    groups = args.groups or list(GROUPS)
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(
            f"unknown group(s) {', '.join(sorted(unknown))}; there are {', '.join(GROUPS)}"
        )
    if args.clean:
        for group in groups:
            shutil.rmtree(WORK / group, ignore_errors=True)
            save_verdicts(group, [])
    status = 0
    if not args.report:
        for group in groups:
            status |= run_group(group, retest=args.retest, jobs=args.jobs)
    write_report()
    return status


if __name__ == "__main__":
    sys.exit(main())
