"""The shared benchmark workloads: deterministic, seeded, defined once.

Every notebook and `minivllm bench` measures on these, so numbers from different chapters
describe the same work. A workload is a list of prompts (token ids, built with the model's
chat template so they look like real chat requests) and the number of tokens to generate for
each; `ignore_eos` makes every request produce exactly that many, so methods do equal work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from minivllm.tokenizer import apply_chat_template

# A small fixed vocabulary of ordinary words: prompts read like text and tokenize like text.
_WORDS = (
    "the model reads a prompt and writes an answer one token at a time while the cache keeps "
    "keys and values of every earlier token so that each new step only computes the newest "
    "position memory is split into blocks requests arrive and leave the scheduler fills the "
    "batch again after every step throughput latency kernel tensor layer attention softmax "
    "query head vector matrix river mountain city garden music history science language"
).split()


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # token ids of each request's prompt
    output_lengths: list[int]  # tokens to generate per request (exactly, with ignore_eos)
    description: str
    # Requests are submitted in this many equal waves, each after the previous one finished
    # (the turns of a conversation); 1 = all at once.
    num_waves: int = 1

    def waves(self) -> list[range]:
        """Index ranges of the requests of each wave."""
        size = -(-self.num_requests // self.num_waves)
        return [
            range(i, min(i + size, self.num_requests)) for i in range(0, self.num_requests, size)
        ]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def chat_prompt_of_length(tokenizer, length: int, rng: random.Random) -> list[int]:
    """A chat-formatted prompt of exactly `length` tokens (at least the template's own size).

    The user message is random words; we tokenize a message that is surely long enough and
    cut its tokens so that template + message is exactly `length` tokens.
    """
    marker = "\x00"
    wrapped = apply_chat_template(tokenizer, [{"role": "user", "content": marker}])
    marker_ids = tokenizer.encode(marker, add_special_tokens=False)
    cut = _find_sublist(wrapped, marker_ids)
    head, tail = wrapped[:cut], wrapped[cut + len(marker_ids) :]
    words = " ".join(rng.choice(_WORDS) for _ in range(length))
    content = tokenizer.encode(words, add_special_tokens=False)
    room = max(length - len(head) - len(tail), 1)
    return head + content[:room] + tail


def _find_sublist(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    raise ValueError("the chat template does not contain the message text")


def shuffled_spread(low: int, high: int, count: int, rng: random.Random) -> list[int]:
    """`count` integers spread evenly from low to high (both included), in a seeded random order."""
    values = [low + round(i * (high - low) / max(count - 1, 1)) for i in range(count)]
    rng.shuffle(values)
    return values


def throughput_workload(
    tokenizer,
    num_requests: int = 64,
    prompt_lengths: tuple[int, int] = (20, 300),
    output_length: int = 64,
    seed: int = 0,
) -> Workload:
    """Many chat requests, prompt lengths spread evenly over a range, a fixed output length."""
    rng = random.Random(seed)
    low, high = prompt_lengths
    lengths = shuffled_spread(low, high, num_requests, rng)
    return Workload(
        name="throughput",
        prompts=[chat_prompt_of_length(tokenizer, n, rng) for n in lengths],
        output_lengths=[output_length] * num_requests,
        description=(
            f"{num_requests} chat requests, prompts {low}-{high} tokens, {output_length} new "
            "tokens each"
        ),
    )


def varied_output_workload(
    tokenizer,
    num_requests: int = 64,
    prompt_lengths: tuple[int, int] = (20, 300),
    output_lengths: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> Workload:
    """Like `throughput_workload`, but output lengths spread too: static batching's worst case."""
    base = throughput_workload(tokenizer, num_requests, prompt_lengths, 1, seed)
    low, high = output_lengths
    lengths = shuffled_spread(low, high, num_requests, random.Random(seed + 1))
    return Workload(
        name="varied-output",
        prompts=base.prompts,
        output_lengths=lengths,
        description=(
            f"{num_requests} chat requests, prompts {prompt_lengths[0]}-{prompt_lengths[1]} "
            f"tokens, outputs {low}-{high} tokens"
        ),
    )


def shared_prefix_workload(
    tokenizer,
    num_requests: int = 64,
    system_prompt_length: int = 1000,
    output_length: int = 16,
    seed: int = 0,
) -> Workload:
    """Many requests that share one long system prompt and differ in a short question: the
    case prefix caching is for (chapter 05)."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(_WORDS) for _ in range(system_prompt_length))
    system_ids = tokenizer.encode(system, add_special_tokens=False)[: system_prompt_length - 10]
    system = tokenizer.decode(system_ids)
    prompts = []
    for i in range(num_requests):
        question = f"Question {i}: " + " ".join(rng.choice(_WORDS) for _ in range(12)) + "?"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompts.append(apply_chat_template(tokenizer, messages))
    return Workload(
        name="shared-prefix",
        prompts=prompts,
        output_lengths=[output_length] * num_requests,
        description=(
            f"{num_requests} chat requests sharing a {system_prompt_length}-token system prompt, "
            f"short distinct questions, {output_length} new tokens each"
        ),
    )


def multi_turn_workload(
    tokenizer,
    num_conversations: int = 8,
    num_turns: int = 4,
    output_length: int = 16,
    seed: int = 0,
) -> Workload:
    """Conversations that grow turn by turn: each request resends the whole history so far.

    The assistant turns are fixed text (not generated), so the workload is known in advance;
    run the requests in order, turn by turn, for the cache to see each history again.
    """
    rng = random.Random(seed)
    prompts = []
    histories = [[] for _ in range(num_conversations)]
    for _turn in range(num_turns):
        for history in histories:
            question = " ".join(rng.choice(_WORDS) for _ in range(30)) + "?"
            history.append({"role": "user", "content": question})
            prompts.append(apply_chat_template(tokenizer, history))
            answer = " ".join(rng.choice(_WORDS) for _ in range(output_length))
            history.append({"role": "assistant", "content": answer})
    return Workload(
        name="multi-turn",
        prompts=prompts,
        output_lengths=[output_length] * len(prompts),
        description=(
            f"{num_conversations} conversations x {num_turns} turns, each turn resending the "
            f"history, {output_length} new tokens each"
        ),
        num_waves=num_turns,
    )


def long_context_workload(
    tokenizer,
    num_requests: int = 8,
    context_lengths: tuple[int, int] = (2048, 8192),
    output_length: int = 64,
    seed: int = 0,
) -> Workload:
    """A few requests whose prompt and answer together fill 2k-8k tokens (SmolLM2 allows
    8,192): every step's attention reads thousands of cached keys per sequence, so attention,
    not the linear layers, is most of the work."""
    low, high = context_lengths
    prompt_lengths = (low - output_length, high - output_length)
    return replace(
        throughput_workload(tokenizer, num_requests, prompt_lengths, output_length, seed),
        name="long-context",
        description=(
            f"{num_requests} chat requests, contexts of {low}-{high} tokens "
            f"(prompt + {output_length} new tokens)"
        ),
    )


# Requests per workload when none is asked for: a long context is 30-100 short prompts of work.
DEFAULT_NUM_REQUESTS = {"long-context": 8}
WORKLOAD_NAMES = ("throughput", "varied-output", "shared-prefix", "multi-turn", "long-context")


def make_workload(
    name: str, tokenizer, num_requests: int | None = None, output_length: int | None = None
):
    """A shared workload by name, as `minivllm bench --workload` names them."""
    num_requests = num_requests or DEFAULT_NUM_REQUESTS.get(name, 64)
    if name == "throughput":
        return throughput_workload(tokenizer, num_requests, output_length=output_length or 64)
    if name == "varied-output":
        return varied_output_workload(tokenizer, num_requests)
    if name == "shared-prefix":
        return shared_prefix_workload(tokenizer, num_requests, output_length=output_length or 16)
    if name == "multi-turn":
        turns = 4
        return multi_turn_workload(
            tokenizer, max(num_requests // turns, 1), turns, output_length=output_length or 16
        )
    if name == "long-context":
        return long_context_workload(tokenizer, num_requests, output_length=output_length or 64)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
