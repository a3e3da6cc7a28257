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
  once, on a background thread, so that a slow compile never stalls other requests' steps.
- `RequestGrammar` (one per sequence): its matcher. The scheduler waits for its compile before
  admitting it, asks it for this step's masks (one per row the runner samples: with draft tokens
  of chapter 08, one per draft position), keeps only the drafts the grammar allows, and advances
  it with every emitted token. A preempted sequence keeps its output tokens, so its matcher
  stays where it was.
- `apply_token_bitmasks`: the model runner masks the logits rows before sampling.

`parse_grammar` is also called when a request is checked (`engine/processor.py`), so a spec that
does not parse is refused before anything is queued, online and offline alike.
"""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from minivllm.sample.sampling_params import StructuredOutputsParams

XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class StructuredOutputManager:
    """Checks and compiles grammars for one engine's tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.vocab_size = vocab_size
        # The tokenizer's vocabulary, padded to the model's (embedding rows past the tokenizer's
        # entries are never allowed).
        tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(tokenizer_info)
        self.compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.compiled: dict[str, Future] = {}  # spec key -> its compile, shared by its requests
        self.num_compiles = 0

    def grammar_for(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher state for one sequence. Raises ValueError for a spec that does not
        parse; the compile itself runs in the background (or is reused)."""
        key = spec.key()
        if key not in self.compiled:
            grammar = parse_grammar(spec)
            self.num_compiles += 1
            self.compiled[key] = self.compile_pool.submit(self.compiler.compile_grammar, grammar)
        return RequestGrammar(self.compiled[key], self.vocab_size)


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
            # adding them until max_tokens.
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
        return xgrammar.Grammar.from_ebnf(value)
    except RuntimeError as error:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(f"structured_outputs.{kind} is not valid: {plain(error)}") from None


def plain(error: RuntimeError) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix."""
    return XGRAMMAR_PREFIX.sub("", str(error).strip().splitlines()[-1])


class RequestGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Future, vocab_size: int):
        self._compiled = compiled
        self._matcher = None
        self.vocab_size = vocab_size

    @property
    def is_ready(self) -> bool:
        """Whether the compile has finished (the scheduler admits the sequence only then)."""
        return self._compiled.done()

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
        far, then after each draft in turn (chapter 08's rows). Leaves the matcher where it was."""
        import xgrammar

        bitmasks = xgrammar.allocate_token_bitmask(len(draft_token_ids) + 1, self.vocab_size)
        for row, token in enumerate(draft_token_ids):
            self.matcher.fill_next_token_bitmask(bitmasks, row)
            self.matcher.accept_token(token)
        if self.matcher.is_terminated():
            # The last draft ended the sequence: what the target samples after it is dropped.
            bitmasks[-1] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmasks, len(draft_token_ids))
        self.matcher.rollback(len(draft_token_ids))
        return bitmasks

    def valid_drafts(self, draft_token_ids: list[int]) -> list[int]:
        """The drafts up to the first one the grammar forbids (a draft model or an n-gram
        lookup knows nothing of the grammar)."""
        accepted = 0
        for token in draft_token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break  # forbidden, or past the end of the sequence
            accepted += 1
        self.matcher.rollback(accepted)
        return draft_token_ids[:accepted]

    def accept(self, token_id: int) -> None:
        """Advance past an emitted token (one the mask allowed)."""
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} was emitted although the grammar forbids it")


def apply_token_bitmasks(logits: torch.Tensor, rows: list[int], bitmasks: torch.Tensor) -> None:
    """Set the forbidden tokens' logits to -inf in the given rows, in place (bitmasks[i]
    belongs to logits[rows[i]]). Bit j of word w is token 32 * w + j; bits past the vocabulary
    are ignored. (Written out rather than xgrammar's CPU kernel, which can write past the end
    of a row whose length is not a whole number of 32-token words.)"""
    vocab_size = logits.shape[-1]
    # Shift each word right by 0..31 and keep the lowest bit. On int32 the shift is arithmetic,
    # but the bit kept is still bit j, so the sign bit (31) reads like any other.
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmasks.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.flatten(-2)[:, :vocab_size].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
