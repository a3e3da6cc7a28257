"""The learning checks themselves are checked: each passes on minivllm's implementation and
on its solution, and fails, with a counterexample, on a typical learner's mistake. A stub
(an exercise not written yet) gets a readable "not implemented yet", and an exception in the
learner's code is reported with the learner's line."""

import importlib
import pkgutil

import pytest
import torch

import minivllm.learning_checks as learning_checks
from minivllm.learning_checks import (
    Status,
    all_checks,
    assert_check,
    check,
    get_solution,
    run_check,
    solution_path,
)


def _layer_norm_instead_of_rms_norm(x, weight, eps):
    """Subtracts the mean: LayerNorm, not RMSNorm."""
    centered = x - x.mean(-1, keepdim=True)
    return centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_on_interleaved_pairs(x, positions, theta):
    """Rotates features (0,1), (2,3), ... (GPT-J style) where Llama pairs i with i + d/2."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _generate_ignoring_eos(model, prompt_token_ids, max_new_tokens, eos_token_id):
    """Forgets to stop at EOS."""
    from minivllm.baselines.naive import generate_without_cache

    return generate_without_cache(model, prompt_token_ids, max_new_tokens, eos_token_id=None)


def _kv_bytes_keys_only(num_layers, num_kv_heads, head_dim, dtype):
    """Counts the keys but not the values."""
    return num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _decode_attention_without_mask(q, keys, values, seq_lens):
    """Attends over every slot, including the empty ones past the row's length."""
    group = q.shape[1] // keys.shape[2]
    k = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [batch, heads, slots, dim]
    v = values.repeat_interleave(group, dim=2).transpose(1, 2)
    weights = torch.softmax((k @ q[..., None])[..., 0] / q.shape[-1] ** 0.5, dim=-1)
    return (weights[:, :, None, :] @ v)[:, :, 0, :]


def _slot_mapping_without_block_size(block_table, block_size, start, end):
    """Adds the offset to the block id instead of to the block's first slot."""
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]


def _paged_attention_causal_from_the_top(q, kv, block_tables, seq_lens, query_lens):
    """Gathers the right blocks but aligns the causal mask top-left: a chunk's first query
    sees only key 0 instead of every cached token before it."""
    out, start = [], 0
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens):
        keys = kv[0, table].flatten(0, 1)[:seq_len].transpose(0, 1)
        values = kv[1, table].flatten(0, 1)[:seq_len].transpose(0, 1)
        queries = q[start : start + query_len].transpose(0, 1)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, enable_gqa=True
            ).transpose(0, 1)
        )
        start += query_len
    return torch.cat(out)


def _schedule_step_seats_ignore_running(running, waiting, budget, max_num_seqs):
    """Admits up to max_num_seqs waiting requests, forgetting the seats the running ones hold."""
    got_running, got_waiting = [], []
    for remaining in running:
        grant = min(remaining, budget)
        got_running.append(grant)
        budget -= grant
    for prompt_len in waiting:
        seats_left = max_num_seqs - sum(g > 0 for g in got_waiting)
        grant = min(prompt_len, budget) if seats_left > 0 else 0
        got_waiting.append(grant)
        budget -= grant
    return got_running, got_waiting


def _prepare_inputs_decode_one_position_ahead(
    token_ids, num_computed, num_scheduled, block_tables, block_size
):
    """Lays the batch out right, but gives a decode token position num_computed + 1 (the
    length of the sequence) instead of num_computed: RoPE would turn it one step too far."""
    input_ids, positions, slots, sample_rows = [], [], [], []
    for tokens, start, count, table in zip(token_ids, num_computed, num_scheduled, block_tables):
        end = start + count
        input_ids += tokens[start:end]
        shift = 1 if count == 1 and start > 0 else 0
        positions += [p + shift for p in range(start, end)]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        if end == len(tokens):
            sample_rows.append(len(input_ids) - 1)
    return input_ids, positions, slots, sample_rows


def _schedule_admitting_after_preemption(
    running, waiting, budget, max_num_seqs, num_blocks, block_size
):
    """Preempts the newest running request when the pool runs out, as it should, but then goes
    on to admit waiting requests in the same step (often the victim's own blocks go to them)."""

    def blocks(num_tokens):
        return -(-num_tokens // block_size)

    held = [blocks(computed) for computed, _ in running]
    free = num_blocks - sum(held)
    kept, preempted = list(range(len(running))), []
    got_running, got_waiting = [0] * len(running), [0] * len(waiting)
    index = 0
    while index < len(kept) and budget > 0:
        request = kept[index]
        computed, remaining = running[request]
        grant = min(remaining, budget)
        extra = blocks(computed + grant) - held[request]
        while extra > free and request not in preempted:
            victim = kept.pop()
            preempted.append(victim)
            free += held[victim]
            held[victim] = 0
        if request in preempted:
            break
        free -= extra
        held[request] += extra
        got_running[request] = grant
        budget -= grant
        index += 1
    seats = max_num_seqs - len(kept)
    for j, prompt_len in enumerate(waiting):  # the mistake: no `if preempted: stop` before
        grant = min(prompt_len, budget)
        if grant == 0 or seats == 0 or blocks(grant) > free:
            break
        got_waiting[j] = grant
        free -= blocks(grant)
        budget -= grant
        seats -= 1
    return got_running, got_waiting, preempted, free


def _block_hashes_without_chain(token_ids, block_size, salt):
    """Hashes each block's own tokens (and the salt), forgetting the blocks before it: two
    prompts that differ early but share a later block would share that block's K/V."""
    import hashlib

    return [
        hashlib.sha256(repr((salt, token_ids[i : i + block_size])).encode()).digest()
        for i in range(0, len(token_ids) - block_size + 1, block_size)
    ]


def _cached_prefix_length_without_last_token(block_hashes, cached, num_tokens, block_size):
    """Serves every leading cached block, even when that covers the whole prompt: no token is
    left to compute, so there are no logits to sample the first output token from."""
    num_cached = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        num_cached += 1
    return num_cached * block_size


def _gather_kv_along_the_inner_dimension_wrongly(kv, block_tables, length):
    """Reads slot p % block_size of block p // block_size of the *pool*, not of the sequence's
    own table: right only when the table happens to be 0, 1, 2, ..."""
    num_seqs = block_tables.shape[0]
    block_size = kv.shape[2]
    positions = torch.arange(length)
    keys = kv[0][positions // block_size, positions % block_size]
    values = kv[1][positions // block_size, positions % block_size]
    return keys.expand(num_seqs, *keys.shape), values.expand(num_seqs, *values.shape)


BROKEN = {
    "ch00.rms_norm": _layer_norm_instead_of_rms_norm,
    "ch00.rope": _rope_on_interleaved_pairs,
    "ch01.generate_without_cache": _generate_ignoring_eos,
    "ch02.kv_bytes_per_token": _kv_bytes_keys_only,
    "ch02.decode_attention": _decode_attention_without_mask,
    "ch03.slot_mapping": _slot_mapping_without_block_size,
    "ch03.paged_attention": _paged_attention_causal_from_the_top,
    "ch04.schedule_step": _schedule_step_seats_ignore_running,
    "ch04.prepare_inputs": _prepare_inputs_decode_one_position_ahead,
    "ch04.schedule_with_preemption": _schedule_admitting_after_preemption,
    "ch05.block_hashes": _block_hashes_without_chain,
    "ch05.cached_prefix_length": _cached_prefix_length_without_last_token,
    "chA.gather_kv": _gather_kv_along_the_inner_dimension_wrongly,
}


# The chapters whose typical mistakes are kept here; a chapter added later may keep its own in
# its test module (chapter 01b: tests/test_ch01b_decoding.py).
CHAPTERS_WITH_MISTAKES_HERE = {"ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "chA"}


def test_every_check_has_a_broken_example():
    """Each registered check of those chapters is exercised below with a wrong implementation."""
    checks = {name for name in all_checks() if name.split(".")[0] in CHAPTERS_WITH_MISTAKES_HERE}
    assert checks == set(BROKEN)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_passes_on_minivllm(name):
    """minivllm's own implementation passes its chapter's check."""
    assert_check(name, all_checks()[name].reference())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_fails_on_a_typical_mistake(name):
    """A typical mistake fails, and the report shows a minimal failing input."""
    result = run_check(name, BROKEN[name])
    assert not result.passed
    shown = ("Falsifying example", "Failing test case", "Failing explicit example")
    assert any(words in result.report for words in shown)
    assert "FAIL" in str(result)


ALL_CHECKS = sorted(all_checks())


@pytest.mark.parametrize("name", ALL_CHECKS)
def test_every_solution_passes_its_check(name):
    """The solution kept apart from the notebooks, solutions.chXX.name, passes check chXX.name."""
    solution = get_solution(name)
    assert solution.__module__ == solution_path(name).rpartition(".")[0]
    assert_check(name, solution)


def test_solutions_do_not_import_minivllm():
    """A solution is written as a learner would write it, not by calling minivllm's own code."""
    import minivllm.learning_checks.solutions as solutions

    for module in pkgutil.iter_modules(solutions.__path__):
        source = importlib.import_module(f"{solutions.__name__}.{module.name}").__loader__
        text = source.get_source(f"{solutions.__name__}.{module.name}")
        assert "import minivllm" not in text and "from minivllm" not in text, module.name


def test_every_chapter_module_is_discovered():
    """Every chapter*.py module of the package registers checks, without being listed."""
    chapters = [
        module.name
        for module in pkgutil.iter_modules(learning_checks.__path__)
        if module.name.startswith("chapter")
    ]
    prefixes = {name.partition(".")[0] for name in all_checks()}
    assert {"ch" + chapter.removeprefix("chapter") for chapter in chapters} == prefixes


@pytest.fixture
def no_fallback(monkeypatch):
    """As a learner runs a notebook: a stub is not replaced by the solution."""
    monkeypatch.delenv("MINIVLLM_QUICK", raising=False)
    monkeypatch.delenv("MINIVLLM_CHECK_SOLUTIONS", raising=False)


def _stub(*args, **kwargs):
    """An exercise cell as the notebook hands it out."""
    raise NotImplementedError("write it in the cell above")


@pytest.mark.parametrize("name", ALL_CHECKS)
def test_a_stub_is_not_implemented_yet(name, no_fallback, capsys):
    """A stub gets a one-line "not implemented yet" with the signature, and no traceback."""
    result = check(name, _stub)
    output = capsys.readouterr().out
    assert result.status is Status.NOT_IMPLEMENTED and not result and not result.passed
    assert result.solution is None
    assert output.startswith(f"{name}: not implemented yet: write ")
    assert "in the cell above; then run this cell again" in output
    assert "Traceback" not in output and "Error" not in output
    assert output.count("\n") == 1
    with pytest.raises(AssertionError, match="not implemented yet"):
        assert_check(name, _stub)


@pytest.mark.parametrize("variable", ["MINIVLLM_CHECK_SOLUTIONS", "MINIVLLM_QUICK"])
def test_a_stub_falls_back_to_the_solution(variable, no_fallback, monkeypatch, capsys):
    """In CI (MINIVLLM_QUICK=1) or on request, a stub's check runs on the solution instead."""
    monkeypatch.setenv(variable, "1")
    result = check("ch03.slot_mapping", _stub)
    output = capsys.readouterr().out
    assert result.status is Status.NOT_IMPLEMENTED
    assert result.solution is not None and result.solution.passed
    assert "not implemented yet" in output
    assert f"checking the solution {solution_path('ch03.slot_mapping')} instead: PASS" in output


def test_a_broken_solution_fails_in_ci(no_fallback, monkeypatch, capsys):
    """With the fallback on, a solution that fails its check makes the notebook cell raise."""
    import minivllm.learning_checks.solutions.ch03 as solutions_ch03

    monkeypatch.setenv("MINIVLLM_CHECK_SOLUTIONS", "1")
    monkeypatch.setattr(solutions_ch03, "slot_mapping", _slot_mapping_without_block_size)
    with pytest.raises(AssertionError, match="fails its check") as raised:
        check("ch03.slot_mapping", _stub)
    assert "FAIL ch03.slot_mapping" in str(raised.value)


def test_a_written_function_is_checked_whatever_the_environment(monkeypatch, capsys):
    """The fallback is for stubs only: a learner's own function is always the one checked."""
    monkeypatch.setenv("MINIVLLM_CHECK_SOLUTIONS", "1")
    result = check("ch03.slot_mapping", _slot_mapping_without_block_size)
    assert result.status is Status.FAILED and result.solution is None
    assert capsys.readouterr().out.startswith("FAIL ch03.slot_mapping")


def _slot_mapping_one_past_the_table(block_table, block_size, start, end):
    slots = []
    for position in range(start, end):
        block = block_table[position // block_size + 1]  # the learner's line that raises
        slots.append(block * block_size + position % block_size)
    return slots


def test_an_exception_reports_the_learners_line(no_fallback):
    """An exception in the learner's code: the report names the line, shows its source and
    the call's arguments, and keeps hypothesis' minimal failing input; no traceback."""
    result = run_check("ch03.slot_mapping", _slot_mapping_one_past_the_table)
    assert result.status is Status.FAILED
    lines = _slot_mapping_one_past_the_table.__code__.co_firstlineno
    assert "IndexError: list index out of range" in result.report
    assert (
        f"test_learning_checks.py, line {lines + 3}, in _slot_mapping_one_past_the_table"
        in result.report
    )
    assert "block = block_table[position // block_size + 1]" in result.report
    assert "in the call _slot_mapping_one_past_the_table(block_table=[0], block_size=1, " in (
        result.report
    )
    assert "Failing test case" in result.report or "Falsifying example" in result.report
    assert "Traceback" not in result.report


def _rms_norm_via_an_abstract_method(x, weight, eps):
    import logging

    logging.Handler().emit(None)  # the standard library's NotImplementedError, from inside it
    return x


def _rms_norm_in_float8(x, weight, eps):
    return torch.zeros(1, dtype=torch.float8_e4m3fn) + 1 + x  # PyTorch: not implemented


@pytest.mark.parametrize(
    "function, line",
    [
        (_rms_norm_via_an_abstract_method, "logging.Handler().emit(None)"),
        (_rms_norm_in_float8, "return torch.zeros(1, dtype=torch.float8_e4m3fn) + 1 + x"),
    ],
)
def test_a_library_not_implemented_error_is_a_failure(function, line, no_fallback):
    """NotImplementedError raised inside a library (Python or C code) is a bug to report, not
    a stub."""
    try:
        function(torch.ones(1, 1), torch.ones(1), 1e-6)
    except NotImplementedError:
        pass
    else:
        pytest.skip("this PyTorch implements the operation")
    result = run_check("ch00.rms_norm", function)
    assert result.status is Status.FAILED
    assert "NotImplementedError" in result.report
    assert line in result.report


def _rms_norm_returning_a_list(x, weight, eps):
    return (x / x.pow(2).mean(-1, keepdim=True).add(eps).sqrt() * weight).tolist()


def test_an_error_in_the_check_shows_what_the_function_returned(no_fallback):
    """When the check itself fails on the learner's answer, the report shows that answer."""
    result = run_check("ch00.rms_norm", _rms_norm_returning_a_list)
    assert result.status is Status.FAILED
    assert "raised by the check, on what your function returned: [[" in result.report


def test_a_function_written_in_part_says_where_it_stops(no_fallback):
    """NotImplementedError after some inputs passed: still "not implemented yet", with the
    input it gave up on and the line that raised."""
    calls = []

    def slot_mapping_for_one_input(block_table, block_size, start, end):
        calls.append(start)
        if len(calls) > 1:
            raise NotImplementedError("only the first input so far")
        return get_solution("ch03.slot_mapping")(block_table, block_size, start, end)

    result = run_check("ch03.slot_mapping", slot_mapping_for_one_input)
    assert result.status is Status.NOT_IMPLEMENTED
    assert "it returned for 1 input(s), then raised NotImplementedError(" in result.report
    assert "only the first input so far" in result.report
    assert "in the call slot_mapping_for_one_input(block_table=" in result.report
