"""The shared benchmark workloads (design §7): deterministic, seeded, defined once.

Every notebook and `minivllm bench` measures on these, so numbers from different chapters
describe the same work. A workload is a list of prompts (token ids, built with the model's
chat template so they look like real chat requests) and the number of tokens to generate for
each; `ignore_eos` makes every request produce exactly that many, so methods do equal work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lengths)


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
    lengths = [
        low + round(i * (high - low) / max(num_requests - 1, 1)) for i in range(num_requests)
    ]
    rng.shuffle(lengths)
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
    rng = random.Random(seed + 1)
    low, high = output_lengths
    lengths = [
        low + round(i * (high - low) / max(num_requests - 1, 1)) for i in range(num_requests)
    ]
    rng.shuffle(lengths)
    return Workload(
        name="varied-output",
        prompts=base.prompts,
        output_lengths=lengths,
        description=(
            f"{num_requests} chat requests, prompts {prompt_lengths[0]}-{prompt_lengths[1]} "
            f"tokens, outputs {low}-{high} tokens"
        ),
    )
