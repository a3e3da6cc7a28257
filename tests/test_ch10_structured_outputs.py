"""Chapter 10 checks: a grammar decides the form of the output, never anything else.

The mask: every token it allows continues the grammar, and the ones that start a valid output
are among them. The engine: constrained outputs parse (JSON that fits its schema, a full regex
match, one of the choices) at any temperature, in a batch with free requests whose tokens do
not change; under preemption and with speculative decoding the tokens are those of the plain
run; a slow compile holds up only its own request; a bad spec is a clear error and leaves the
engine serving with every block free.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty, chat_prompt_ids
from hypothesis import given
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.structured_output.emptiness import matches_a_finite_string
from minivllm.structured_output.manager import (
    CompiledGrammarCache,
    StructuredOutputManager,
    apply_token_bitmasks,
    compile_failure,
    parse_grammar,
    plain,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PHONE = r"\d{3}-\d{4}"
# Schemas with what applications use: nesting, arrays, enums, bounds, patterns, required fields.
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "address", "hobbies", "role"],
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 25},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["product", "quantity", "price"],
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["items", "paid"],
}


def json_params(**kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON), **kwargs)


def is_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and isinstance(value["age"], int)
    )


# Room for about 5,800 tokens of the embedded model: plenty here, and a tenth of the default.
SMALL_KV_CACHE = 256 * 1024**2


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=SMALL_KV_CACHE)


@pytest.fixture(scope="module")
def person_prompts(tokenizer) -> list[dict]:
    messages = [
        "Describe a person as JSON with a name and an age.",
        "Invent a character for a novel and give their name and age as JSON.",
        "Who is the oldest person you know of? Answer in JSON.",
        "Write a haiku about the sea.",  # not a request for JSON: the grammar insists anyway
    ]
    return [{"prompt_token_ids": chat_prompt_ids(tokenizer, m)} for m in messages]


# --- the mask -----------------------------------------------------------------------------------


def test_a_choice_mask_allows_exactly_the_tokens_that_begin_a_choice(tokenizer):
    choices = ["yes", "no", "maybe later"]
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    grammar = manager.grammar_for(StructuredOutputsParams(choice=choices))
    bitmask = grammar.token_bitmasks([])[0]
    allowed = [t for t in range(len(tokenizer)) if (int(bitmask[t // 32]) >> (t % 32)) & 1]
    texts = [tokenizer.decode([t]) for t in allowed]
    assert texts, "nothing allowed"
    assert all(any(c.startswith(text) for c in choices) for text in texts), texts
    # The first token of each choice's own tokenization is allowed.
    for choice in choices:
        assert tokenizer.encode(choice, add_special_tokens=False)[0] in allowed
    # After "no" the grammar is complete: only the end of the sequence may follow.
    for token in tokenizer.encode("no", add_special_tokens=False):
        grammar.accept(token)
    after = grammar.token_bitmasks([])[0]
    allowed_after = [t for t in range(len(tokenizer)) if (int(after[t // 32]) >> (t % 32)) & 1]
    assert allowed_after == [tokenizer.eos_token_id]


def test_a_draft_mask_row_follows_the_drafts_and_invalid_drafts_are_cut(tokenizer):
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    grammar = manager.grammar_for(StructuredOutputsParams(regex=PHONE))
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "5551234"]
    dash = tokenizer.convert_tokens_to_ids("-")
    drafts = digits[:3] + [dash]
    masks = grammar.token_bitmasks(drafts)
    assert masks.shape[0] == len(drafts) + 1

    def allows(row: int, token: int) -> bool:
        return bool((int(masks[row][token // 32]) >> (token % 32)) & 1)

    assert allows(0, digits[0]) and not allows(0, dash)
    assert allows(3, dash) and not allows(3, digits[0])  # after three digits: the dash
    assert allows(4, digits[3]) and not allows(4, dash)
    assert grammar.valid_drafts(digits[:2] + [dash, dash]) == digits[:2]  # cut at the bad dash
    assert grammar.token_bitmasks([]).equal(masks[:1])  # the matcher was left where it was


# --- the engine ---------------------------------------------------------------------------------


def test_constrained_outputs_parse_at_any_temperature_beside_free_requests(llm, person_prompts):
    free_prompt = person_prompts[0]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate(free_prompt, free, use_tqdm=False)[0].outputs[0].token_ids
    params = [json_params(temperature=t, seed=s, max_tokens=64) for t in (0.0, 1.0) for s in (1, 2)]
    prompts = person_prompts * 2
    specs = [params[i % len(params)] for i in range(len(prompts))]
    outputs = llm.generate([free_prompt] + prompts, [free] + specs, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone  # the free neighbour is untouched
    for output in outputs[1:]:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        assert is_person(completion.text), completion.text
    assert_pool_is_empty(llm.llm_engine)


@pytest.mark.parametrize("schema", [PROFILE, ORDER], ids=["profile", "order"])
def test_outputs_validate_against_nested_schemas_greedy_and_sampled(llm, tokenizer, schema):
    messages = ["Create a user profile as JSON.", "Write a JSON order for a bakery."]
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, m)} for m in messages] * 2
    spec = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=200, structured_outputs=spec)
        for i, t in enumerate((0.0, 0.0, 1.0, 1.0))
    ]
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_choice_constrain_the_whole_output(llm, tokenizer):
    phone = chat_prompt_ids(tokenizer, "What is your phone number?")
    mood = chat_prompt_ids(tokenizer, "How do you feel today?")
    choices = ["happy", "sad", "so-so"]
    requests, params = [], []
    for seed in range(4):
        requests += [{"prompt_token_ids": phone}, {"prompt_token_ids": mood}]
        params += [
            SamplingParams(
                temperature=1.0,
                seed=seed,
                max_tokens=16,
                structured_outputs=StructuredOutputsParams(regex=PHONE),
            ),
            SamplingParams(
                temperature=1.0,
                seed=seed,
                max_tokens=16,
                ignore_eos=True,  # the completed grammar still ends it
                structured_outputs=StructuredOutputsParams(choice=choices),
            ),
        ]
    for output, request_params in zip(llm.generate(requests, params, use_tqdm=False), params):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"
        if request_params.structured_outputs.regex:
            assert re.fullmatch(PHONE, text), text
        else:
            assert text in choices, text


def test_each_distinct_spec_compiles_once(llm, person_prompts):
    engine = llm.llm_engine
    llm.generate(person_prompts[:2], json_params(temperature=0.0, max_tokens=8), use_tqdm=False)
    compiles = engine.structured_output_manager.num_compiles
    llm.generate(person_prompts, json_params(n=2, max_tokens=8), use_tqdm=False)
    assert engine.structured_output_manager.num_compiles == compiles


def test_a_schemas_property_order_is_its_outputs_field_order(llm, person_prompts):
    """Two schemas with the same properties in another order are different grammars: neither
    may reuse the other's compile."""
    age_first = {
        "type": "object",
        "properties": {"age": {"type": "integer"}, "name": {"type": "string"}},
        "required": ["age", "name"],
    }
    params = [
        json_params(temperature=0.0, max_tokens=40),
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=age_first),
        ),
    ]
    outputs = llm.generate(person_prompts[:1] * 2, params, use_tqdm=False)
    assert list(json.loads(outputs[0].outputs[0].text)) == ["name", "age"]
    assert list(json.loads(outputs[1].outputs[0].text)) == ["age", "name"]


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(json={"type": "objec"}), "structured_outputs.json is not valid"),
        (dict(json="{not json"), "structured_outputs.json is not valid"),
        (dict(regex="(ab"), "structured_outputs.regex is not valid"),
        (dict(grammar='root ::= "a" |'), "structured_outputs.grammar is not valid"),
        # xgrammar's own message for this one cuts a two-byte character in half
        (dict(grammar="\u0096\u0016\u00fb!\u001ea&\r"), "structured_outputs.grammar is not valid"),
    ],
)
def test_a_bad_spec_is_a_clear_error_and_the_engine_keeps_serving(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert_pool_is_empty(llm.llm_engine)
    output = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4


def test_structured_outputs_params_need_exactly_one_field():
    for fields, message in (
        ({}, "exactly one of"),
        ({"json": PERSON, "regex": "a"}, "exactly one of"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"regex": 5}, "structured_outputs.regex"),
        ({"json": 5}, "structured_outputs.json"),
    ):
        with pytest.raises(ValueError, match=message):
            StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": PERSON})


def test_preempted_constrained_requests_give_the_same_outputs(person_prompts):
    """A pool too small for eight JSON answers at once: some are preempted and recomputed.
    Their grammar state lives with their output tokens, which a preemption keeps."""
    prompts = person_prompts[:3] * 3  # the haiku prompt's JSON runs past max_tokens
    params = json_params(temperature=0.0, max_tokens=40)
    roomy = LLM(enable_prefix_caching=False, kv_cache_memory_bytes=SMALL_KV_CACHE)
    roomy = roomy.generate(prompts, params, use_tqdm=False)
    per_token = 46080  # the embedded model's K/V bytes per token in float32
    tight = LLM(kv_cache_memory_bytes=24 * 16 * per_token, max_num_seqs=9)
    cramped = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]
    assert all(is_person(o.outputs[0].text) for o in cramped)


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        {"method": "layer_skip", "num_draft_layers": 20, "num_speculative_tokens": 3},
    ],
)
def test_speculation_under_a_grammar_gives_the_plain_constrained_tokens(
    llm, tokenizer, speculative
):
    """Drafts are cut at the first token the grammar forbids, and every verified row gets the
    mask of its own position."""
    text = '{"name": "Ada Lovelace", "age": 36}'
    prompt = chat_prompt_ids(tokenizer, f"Repeat this JSON exactly: {text}")
    prompts = [{"prompt_token_ids": prompt}] * 2
    params = [
        json_params(temperature=0.0, max_tokens=40),
        json_params(temperature=0.8, seed=3, max_tokens=40),
    ]
    plain = llm.generate(prompts, params, use_tqdm=False)
    speculative_llm = LLM(speculative_config=speculative, kv_cache_memory_bytes=SMALL_KV_CACHE)
    got = speculative_llm.generate(prompts, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert all(is_person(o.outputs[0].text) for o in got)
    seen = {m.name: m.value for m in speculative_llm.get_metrics()}
    assert seen["vllm:spec_decode_num_draft_tokens"] > 0


def test_a_slow_compile_holds_up_only_its_own_request(tiny_model_dirs, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs[ENGINE_TEST_FAMILY])))
    release = threading.Event()
    engine.add_request("free", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6))
    engine.add_request("warm", "Hi", json_params(max_tokens=1))  # builds the manager
    while engine.has_unfinished_requests():
        engine.step()
    compiler = engine.structured_output_manager.compiler
    original = compiler.compile_grammar

    def slow_compile(grammar):
        release.wait(timeout=30)
        return original(grammar)

    monkeypatch.setattr(compiler, "compile_grammar", slow_compile)
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    engine.add_request("slow", "Pick one", SamplingParams(max_tokens=8, structured_outputs=choice))
    engine.add_request("free", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6))
    finished = {}
    for _ in range(8):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert "free" in finished and "slow" not in finished
    assert [r.request_id for r in engine.scheduler.waiting] == ["slow#0"]
    release.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["slow"].outputs[0].text in ("alpha", "beta")
    assert_pool_is_empty(engine)


def one_field_schema(i: int) -> StructuredOutputsParams:
    """A per-request schema, as clients that generate field names send them."""
    return StructuredOutputsParams(
        json={"type": "object", "properties": {f"field_{i}": {"type": "integer"}}}
    )


def test_compiled_grammars_are_evicted_beyond_the_cache_budget(tokenizer):
    """Thirty distinct schemas into a cache with room for about three: it keeps to its budget
    (by xgrammar's own count of each compile's bytes), the least recently used go first, a
    request that holds an evicted grammar still uses it, and an evicted spec compiles again."""
    probe = StructuredOutputManager(tokenizer, len(tokenizer)).grammar_for(one_field_schema(0))
    one_grammar = probe._compiled.result().memory_size_bytes
    manager = StructuredOutputManager(tokenizer, len(tokenizer), cache_limit_bytes=3 * one_grammar)
    specs = [one_field_schema(i) for i in range(30)]
    grammars = []
    for spec in specs:
        grammars.append(manager.grammar_for(spec))
        grammars[-1].matcher  # noqa: B018 (waits for the compile)
    manager.grammar_for(specs[-1])  # the cache takes stock of the last compile
    sizes = {spec.key(): g._compiled.result().memory_size_bytes for spec, g in zip(specs, grammars)}
    held = [key for key in sizes if key in manager.cache]
    assert 1 <= len(held) <= 4 and sum(sizes[key] for key in held) <= 3 * one_grammar
    assert specs[-1].key() in manager.cache and specs[0].key() not in manager.cache
    # The first request's grammar was evicted long ago; it still walks its schema.
    for token in tokenizer.encode('{"field_0": 7}', add_special_tokens=False):
        assert grammars[0].accept(token)
    compiles = manager.num_compiles
    again = manager.grammar_for(specs[0])
    assert manager.num_compiles == compiles + 1
    for token in tokenizer.encode('{"field_0": 7}', add_special_tokens=False):
        assert again.accept(token)


def finished_compile(size_bytes: int) -> Future:
    """A stand-in for a finished compile, with xgrammar's count of its bytes."""
    compiled = Future()
    compiled.set_result(SimpleNamespace(memory_size_bytes=size_bytes))
    return compiled


def test_the_cache_keeps_to_its_budget_to_the_byte():
    """Budget 300: three compiles of 100 fill it exactly and all stay; a fourth evicts the
    least recently used one only; one byte over evicts one more; reading a key makes it the
    most recently used. The held size is always the sum of the compiles held."""
    cache = CompiledGrammarCache(limit_bytes=300)
    for key in "abc":
        cache.put(key, finished_compile(100))
    assert [k for k in "abc" if k in cache] == ["a", "b", "c"] and cache.size_bytes == 300
    cache.put("d", finished_compile(100))
    assert [k for k in "abcd" if k in cache] == ["b", "c", "d"] and cache.size_bytes == 300
    assert cache.get("b") is not None  # now c is the least recently used
    cache.put("e", finished_compile(1))
    assert [k for k in "abcde" if k in cache] == ["b", "d", "e"] and cache.size_bytes == 201


def test_a_running_compile_is_kept_and_a_failed_one_dropped_with_the_others_counted():
    """Compiles still running have no size and are never evicted. Once they finish, the next
    look counts them all at once: the failed one is dropped (its spec compiles again next
    time) and the ones after it are counted, here over budget, so the oldest goes."""
    cache = CompiledGrammarCache(limit_bytes=150)
    failing, first, second = Future(), Future(), Future()
    for key, compiled in [("bad", failing), ("x", first), ("y", second)]:
        cache.put(key, compiled)
    assert len(cache) == 3 and cache.size_bytes == 0
    failing.set_exception(RuntimeError("no rule"))
    first.set_result(SimpleNamespace(memory_size_bytes=100))
    second.set_result(SimpleNamespace(memory_size_bytes=100))
    assert cache.get("y") is second
    assert "bad" not in cache and "x" not in cache and cache.size_bytes == 100


def test_one_compile_thread_and_shutdown_cancels_the_queue_without_waiting(tokenizer):
    """Compiles run one at a time on one thread named "grammar" (a slow compile must not take
    more than one core from the engine's steps). Shutdown cancels the compiles still queued
    and returns without waiting for the running one. xgrammar's own compile cache stays off:
    ours is the only copy."""
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    compile_grammar = manager.compiler.compile_grammar
    release, threads = threading.Event(), []

    def blocking_compile(grammar):
        threads.append(threading.current_thread().name)
        release.wait(timeout=30)
        return compile_grammar(grammar)

    manager.compiler.compile_grammar = blocking_compile
    running = manager.grammar_for(StructuredOutputsParams(choice=["a", "b"]))._compiled
    queued = manager.grammar_for(StructuredOutputsParams(choice=["c", "d"]))._compiled
    while not threads:  # the first compile has started
        release.wait(timeout=0.01)
    manager.shutdown()
    assert queued.cancelled() and not running.done()
    release.set()
    running.result(timeout=30)
    assert threads == ["grammar_0"] and manager.num_compiles == 2
    assert manager.compiler.get_cache_size_bytes() == 0


def test_vocabulary_rows_past_the_tokenizers_are_never_allowed(tokenizer):
    """A model's vocabulary may be padded past its tokenizer's (embedding rows no token
    spells): the masks cover the model's width and never allow a padded row."""
    vocab_size = len(tokenizer) + 40
    manager = StructuredOutputManager(tokenizer, vocab_size)
    masks = manager.grammar_for(StructuredOutputsParams(json_object=True)).token_bitmasks([])
    assert masks.shape == (1, -(-vocab_size // 32))
    logits = torch.zeros(1, vocab_size)
    apply_token_bitmasks(logits, [0], masks)
    assert logits[0, len(tokenizer) :].eq(float("-inf")).all()
    assert logits[0, : len(tokenizer)].isfinite().any()


def test_the_grammar_cache_budget_defaults_to_vllms(tokenizer, monkeypatch):
    assert StructuredOutputManager(tokenizer, len(tokenizer)).cache.limit_bytes == 512 * 2**20
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "64")
    assert StructuredOutputManager(tokenizer, len(tokenizer)).cache.limit_bytes == 64 * 2**20


def test_a_kept_forbidden_draft_gets_the_mask_that_forbids_it(tokenizer):
    """A draft drawn from a draft model's q is kept at the first token the grammar forbids (the
    verifier must reject it there, chapter 08); its row forbids it, the row after it allows
    everything (it is never sampled), and the matcher is left where it was."""
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    grammar = manager.grammar_for(StructuredOutputsParams(regex=PHONE))
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "5551234"]
    dash = tokenizer.convert_tokens_to_ids("-")
    before = grammar.token_bitmasks([])
    drafts = grammar.valid_drafts(digits[:2] + [dash, dash], keep_forbidden=True)
    assert drafts == digits[:2] + [dash]
    masks = grammar.token_bitmasks(drafts)

    def allows(row: int, token: int) -> bool:
        return bool((int(masks[row][token // 32]) >> (token % 32)) & 1)

    assert allows(2, digits[0]) and not allows(2, dash)
    assert bool((masks[3] == -1).all())
    assert grammar.token_bitmasks([]).equal(before)
    for token in digits[:3] + [dash]:  # the emitted tokens still walk the grammar
        assert grammar.accept(token)


# --- grammars that match nothing (structured_output/emptiness.py) -----------------------------

# EBNF grammar -> whether it matches some finite string
GRAMMARS = {
    "root ::= root": False,
    'root ::= "a" root': False,
    "root ::= x\nx ::= y\ny ::= x": False,
    'root ::= ("a" | root) root': False,
    'root ::= x+\nx ::= "q" x': False,
    'root ::= x{2,3}\nx ::= "q" x': False,
    'root ::= "a" root | "b"': True,
    'root ::= x*\nx ::= "q" x': True,
    'root ::= x{0,3}\nx ::= "q" x': True,
    'root ::= x\nx ::= "a" | x x': True,
    'root ::= [a-z]* "b"': True,
    'root ::= ""': True,
}


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_a_grammar_matches_a_finite_string_when_some_way_through_it_ends(grammar):
    """The productivity test itself, on xgrammar's parse of each grammar (parse_grammar keeps
    its results in a cache, so a wrong answer for a grammar seen before would not show there)."""
    import xgrammar

    assert matches_a_finite_string(xgrammar.Grammar.from_ebnf(grammar)) == GRAMMARS[grammar]


def test_a_grammar_in_a_format_the_check_does_not_know_is_let_through():
    """The check reads xgrammar's serialized form; a version it was not written for is not
    judged (xgrammar's own compile then decides), never refused by mistake."""
    unknown = SimpleNamespace(serialize_json=lambda: json.dumps({"__VERSION__": "v-next"}))
    assert matches_a_finite_string(unknown)


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_a_grammar_that_matches_no_finite_string_is_refused(grammar):
    spec = StructuredOutputsParams(grammar=grammar)
    if GRAMMARS[grammar]:
        parse_grammar(spec)
    else:
        with pytest.raises(ValueError, match="matches no finite string"):
            parse_grammar(spec)


# --- the bitmask format (apply_token_bitmasks) ---------------------------------------------------


def test_bit_j_of_word_w_allows_token_32w_plus_j():
    """Row 1 of three allows tokens 0, 31 (the sign bit of word 0, a negative int32) and 33; the
    vocabulary of 40 ends inside word 1, whose set bits 8..15 (tokens 40..47) are ignored. The
    rows not named keep their logits."""
    vocab_size = 40
    logits = torch.arange(3 * vocab_size, dtype=torch.float32).view(3, vocab_size)
    before = logits.clone()
    word0 = (1 << 0) | (1 << 31)
    word1 = (1 << 1) | (0xFF << 8)
    bitmask = torch.tensor([[word0 - (1 << 32), word1]], dtype=torch.int32)

    apply_token_bitmasks(logits, [1], bitmask)

    allowed = [t for t in range(vocab_size) if not torch.isneginf(logits[1, t])]
    assert allowed == [0, 31, 33]
    assert logits[1, allowed].tolist() == before[1, allowed].tolist()
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


@given(
    vocab_size=st.integers(1, 100),
    data=st.data(),
)
def test_apply_token_bitmasks_matches_the_bits_one_by_one(vocab_size, data):
    """Random masks on a random choice of rows agree with reading each token's bit by hand."""
    num_rows = data.draw(st.integers(1, 4))
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), unique=True, min_size=1))
    words = (vocab_size + 31) // 32
    int32 = st.integers(-(2**31), 2**31 - 1)
    masks = [data.draw(st.lists(int32, min_size=words, max_size=words)) for _ in rows]
    logits = torch.zeros(num_rows, vocab_size)

    apply_token_bitmasks(logits, rows, torch.tensor(masks, dtype=torch.int32))

    for row in range(num_rows):
        mask = masks[rows.index(row)] if row in rows else None
        for token in range(vocab_size):
            allowed = mask is None or (mask[token // 32] % 2**32) >> (token % 32) & 1
            assert torch.isneginf(logits[row, token]).item() == (not allowed), (row, token)


# --- compile errors as a user reads them -----------------------------------------------------------


def test_an_xgrammar_error_is_its_last_line_without_the_log_prefix():
    """xgrammar prefixes its messages with "[time] file.cc:line: " and may add lines of
    context before the last one; a message of nothing is named by its type."""
    error = RuntimeError("context line\n[10:00:02] grammar_parser.cc:123: Expect ::= at line 1\n")
    assert plain(error) == "Expect ::= at line 1"
    assert plain(ValueError("no prefix here")) == "no prefix here"
    assert plain(KeyError()) == "KeyError"


def test_a_finished_compile_says_why_it_failed_or_nothing():
    succeeded, failed, cancelled = Future(), Future(), Future()
    succeeded.set_result(object())
    failed.set_exception(RuntimeError("[1:2:3] compiler.cc:9: bad rule"))
    cancelled.cancel()
    assert compile_failure(succeeded) is None
    assert compile_failure(failed) == "the grammar failed to compile: bad rule"
    assert compile_failure(cancelled) == "the grammar's compile was cancelled"
