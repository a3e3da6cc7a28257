"""Chapter 10 — grammar-constrained decoding: at every step, forbid each token that would take
the output out of the grammar, so the output always parses.

A grammar (a JSON schema, a regex, a choice of strings, an EBNF grammar) is compiled once into
an automaton over the model's *tokens* (xgrammar, as vLLM uses it). A request then walks that
automaton with a matcher: before each sampled token, the matcher says which tokens may come
next, as a bitmask with one bit per vocabulary entry; the sampler sets every other token's
logit to -inf; the chosen token advances the matcher.

    schema {"type": "object", "properties": {"n": {"type": "integer"}}}
    output so far   {"n":             allowed next: digits, "-"       (not "}", not letters)
    output so far   {"n":4            allowed next: digits, "}"
    output so far   {"n":42}          allowed next: only end-of-sequence

The pieces, and where they run:

- `StructuredOutputManager` (one per engine): checks a request's spec when it arrives (a bad
  schema is a ValueError then, and nothing else is affected), and compiles each distinct spec
  once, on a background thread, so that a slow compile never stalls other requests' steps. The
  compiled grammars are kept in a cache with a byte budget (`CompiledGrammarCache`): a server
  whose clients send a new schema with every request must not grow without bound.
- `RequestGrammar` (one per sequence): its matcher. The scheduler waits for its compile before
  admitting it, asks it for this step's masks (one per row the runner samples: with draft tokens
  of chapter 08, one per draft position), keeps only the drafts worth verifying, and advances
  it with every emitted token. A preempted sequence keeps its output tokens, so its matcher
  stays where it was. A compile that fails, or a token the grammar rejects, ends that one
  sequence with finish_reason "error"; the engine goes on.
- `apply_token_bitmasks`: the model runner masks the logits rows before sampling.

`parse_grammar` is also called when a request is checked (`engine/processor.py`), so a spec that
does not parse, or an EBNF grammar that matches no finite string (`emptiness.py`), is refused
before anything is queued, online and offline alike.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from minivllm.sample.sampling_params import StructuredOutputsParams
from minivllm.structured_output.emptiness import matches_a_finite_string

XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

# The byte budget of compiled grammars, in MiB: vLLM's variable and default.
CACHE_MB_VARIABLE = "VLLM_XGRAMMAR_CACHE_MB"
DEFAULT_CACHE_MB = 512


class StructuredOutputManager:
    """Checks and compiles grammars for one engine's tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, cache_limit_bytes: int | None = None):
        import xgrammar

        self.vocab_size = vocab_size
        # The tokenizer's vocabulary, padded to the model's (embedding rows past the tokenizer's
        # entries are never allowed).
        tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache would keep a second, unbounded copy of every grammar: ours
        # (below) is the only one.
        self.compiler = xgrammar.GrammarCompiler(tokenizer_info, cache_enabled=False)
        self.compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        if cache_limit_bytes is None:
            cache_limit_bytes = int(os.environ.get(CACHE_MB_VARIABLE, DEFAULT_CACHE_MB)) * 2**20
        self.cache = CompiledGrammarCache(cache_limit_bytes)  # spec key -> its compile
        self.num_compiles = 0

    def grammar_for(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher state for one sequence. Raises ValueError for a spec that does not
        parse; the compile itself runs in the background (or is reused)."""
        key = spec.key()
        compiled = self.cache.get(key)
        if compiled is None:
            grammar = parse_grammar(spec)
            self.num_compiles += 1
            compiled = self.compile_pool.submit(self.compiler.compile_grammar, grammar)
            self.cache.put(key, compiled)
        return RequestGrammar(compiled, self.vocab_size)

    def shutdown(self) -> None:
        """Stop the compile thread; compiles still queued are cancelled (the engine is
        stopping: nobody will run their requests)."""
        self.compile_pool.shutdown(wait=False, cancel_futures=True)


class CompiledGrammarCache:
    """Compiles by spec key, least recently used first, within a byte budget: past it, the
    oldest finished compiles are forgotten (xgrammar reports each one's size). A compile still
    running has no size yet and stays; one that failed is dropped, so that the next request for
    its spec tries again. Forgetting never hurts a running request: each holds its own compile
    (a Future) for as long as it lives. Used from the engine's thread only."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.size_bytes = 0  # of the finished compiles held
        self._compiles: OrderedDict[str, Future] = OrderedDict()
        self._sizes: dict[str, int] = {}  # key -> bytes, for the finished compiles
        # Keys whose compile had not finished when last seen, in the order they were put (a
        # dict as an ordered set: they are settled in that order, the same on every run).
        self._running: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self._compiles)

    def __contains__(self, key: str) -> bool:
        return key in self._compiles

    def get(self, key: str) -> Future | None:
        """The compile of `key`, now the most recently used; None if there is none."""
        self._settle()
        compiled = self._compiles.get(key)
        if compiled is not None:
            self._compiles.move_to_end(key)
        return compiled

    def put(self, key: str, compiled: Future) -> None:
        self._compiles[key] = compiled
        self._running[key] = None
        self._settle()

    def _settle(self) -> None:
        """Count the compiles that finished since last time, then evict down to the budget."""
        for key in [key for key in self._running if self._compiles[key].done()]:
            del self._running[key]
            if compile_failure(self._compiles[key]) is not None:
                del self._compiles[key]
                continue
            self._sizes[key] = self._compiles[key].result().memory_size_bytes
            self.size_bytes += self._sizes[key]
        excess, evicted = self.size_bytes - self.limit_bytes, []
        for key in self._compiles:  # least recently used first
            if excess <= 0:
                break
            if key in self._sizes:
                evicted.append(key)
                excess -= self._sizes[key]
        for key in evicted:
            del self._compiles[key]
            self.size_bytes -= self._sizes.pop(key)


def compile_failure(compiled: Future) -> str | None:
    """Why a finished compile failed, in one line; None if it succeeded."""
    if compiled.cancelled():
        return "the grammar's compile was cancelled"
    error = compiled.exception()
    return None if error is None else f"the grammar failed to compile: {plain(error)}"


def parse_grammar(spec: StructuredOutputsParams):
    """The spec as an xgrammar Grammar; a ValueError naming the field if it does not parse.
    Parsed once per distinct spec: every request is checked with it, and the manager compiles
    from it."""
    return _parse_grammar_key(spec.key())


@functools.lru_cache(maxsize=256)
def _parse_grammar_key(key: str):
    """`parse_grammar` by the spec's key ("kind:" + its value as JSON, order kept), so that the
    cache can hash it."""
    import xgrammar

    kind, value_json = key.split(":", 1)
    value = json.loads(value_json)
    try:
        if kind == "json":
            # Compact JSON (no free whitespace): a small model, free to add spaces, may keep
            # adding them until max_tokens. vLLM's xgrammar backend allows any whitespace
            # unless the server sets disable_any_whitespace; both keep xgrammar's strict_mode
            # (no property or item the schema does not list).
            schema = value if isinstance(value, str) else json.dumps(value)
            return xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
        if kind == "json_object":  # any JSON object, as vLLM compiles it
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(value)
        if kind == "choice":
            # One alternative per choice, each a literal string (JSON escapes are EBNF's too).
            return xgrammar.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(choice) for choice in value)
            )
        grammar = xgrammar.Grammar.from_ebnf(value)
        if not matches_a_finite_string(grammar):
            raise ValueError(
                "structured_outputs.grammar matches no finite string: every way through it "
                "recurses without end (as root ::= root does)"
            )
        return grammar
    except RuntimeError as error:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(f"structured_outputs.{kind} is not valid: {plain(error)}") from None
    except UnicodeDecodeError:
        # xgrammar's parse error quotes the grammar byte by byte and may cut a character in
        # two; its message is then no UTF-8 and never becomes a RuntimeError.
        raise ValueError(f"structured_outputs.{kind} is not valid: it does not parse") from None


def plain(error: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix, on one line."""
    lines = str(error).strip().splitlines()
    return XGRAMMAR_PREFIX.sub("", lines[-1]) if lines else type(error).__name__


class RequestGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Future, vocab_size: int):
        self._compiled = compiled
        self._matcher = None
        self.vocab_size = vocab_size

    @property
    def is_ready(self) -> bool:
        """Whether the compile has finished, well or not (the scheduler admits the sequence
        only then, or ends it with `compile_error`)."""
        return self._compiled.done()

    @property
    def compile_error(self) -> str | None:
        """Why the compile failed, once it has; None while it runs or when it succeeded."""
        return compile_failure(self._compiled) if self._compiled.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self._compiled.result())
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (end-of-sequence) was emitted."""
        return self.matcher.is_terminated()

    def token_bitmasks(self, draft_token_ids: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, ceil(vocab / 32)] int32: the tokens allowed after the output so
        far, then after each draft in turn (chapter 08's rows). Leaves the matcher where it was.
        A last draft the grammar forbids (kept to be rejected, see `valid_drafts`) gets the
        mask that forbids it; the row after it is never sampled."""
        import xgrammar

        bitmasks = xgrammar.allocate_token_bitmask(len(draft_token_ids) + 1, self.vocab_size)
        accepted = 0
        for row, token in enumerate(draft_token_ids):
            self.matcher.fill_next_token_bitmask(bitmasks, row)
            if not self.matcher.accept_token(token):
                break  # the forbidden last draft
            accepted += 1
        # The rows after a forbidden draft, or after the end of the sequence, keep the
        # all-allowed mask they were allocated with: what the target samples there is dropped.
        if accepted == len(draft_token_ids) and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmasks, len(draft_token_ids))
        self.matcher.rollback(accepted)
        return bitmasks

    def valid_drafts(self, draft_token_ids: list[int], keep_forbidden: bool = False) -> list[int]:
        """The drafts worth verifying (a draft model or an n-gram lookup knows nothing of the
        grammar): those up to the first one the grammar forbids, and none past the end of the
        sequence. With `keep_forbidden`, the first forbidden draft too: a draft drawn from a
        distribution q that is not one-hot must be verified to keep the output exact (the
        target rejects it, p = 0 there, and draws from the residual max(0, p - q)); cutting it
        would sample from p itself. For a one-hot q the residual is p, so the cut is the same
        and saves a row."""
        accepted = 0
        for token in draft_token_ids:
            if self.matcher.is_terminated():
                break  # past the end of the sequence: nothing after it is emitted
            if not self.matcher.accept_token(token):
                self.matcher.rollback(accepted)
                return draft_token_ids[: accepted + 1 if keep_forbidden else accepted]
            accepted += 1
        self.matcher.rollback(accepted)
        return draft_token_ids[:accepted]

    def accept(self, token_id: int) -> bool:
        """Advance past an emitted token; False if the grammar forbids it (the mask should
        have: the sequence then ends with an error, and the matcher stays where it was)."""
        return self.matcher.is_terminated() or self.matcher.accept_token(token_id)


def apply_token_bitmasks(logits: torch.Tensor, rows: list[int], bitmasks: torch.Tensor) -> None:
    """Set the forbidden tokens' logits to -inf in the given rows, in place (bitmasks[i]
    belongs to logits[rows[i]]). Bit j of word w is token 32 * w + j; bits past the vocabulary
    are ignored. (Written out rather than calling xgrammar's apply_token_bitmask_inplace: the
    format in a few lines, and the same tensor operations on every device.)"""
    vocab_size = logits.shape[-1]
    # Shift each word right by 0..31 and keep the lowest bit. On int32 the shift is arithmetic,
    # but the bit kept is still bit j, so the sign bit (31) reads like any other.
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmasks.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.flatten(-2)[:, :vocab_size].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
