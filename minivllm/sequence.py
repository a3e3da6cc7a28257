"""A sequence's tokens as a prompt followed by an output, shared by the engine's `Request` and
the model runner's own copy of a request (`worker/input_batch.py`): both keep the same fields,
and both need the same three answers — how many tokens, which ones between two positions, and
what the sampler must know about the sequence.
"""

from __future__ import annotations

import torch

from minivllm.sample.sampler import SamplingRow, make_generator
from minivllm.sample.sampling_params import SamplingParams


class SequenceTokens:
    """Mixed into a dataclass that has these fields."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # the sequence's own, when it is seeded
    eos_token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 of prompt + output, without copying the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(
            params=self.params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            generator=self.generator,
            eos_token_ids=self.eos_token_ids,
        )


def own_generator(params: SamplingParams) -> torch.Generator | None:
    """A seeded sequence's own generator, so its samples do not depend on what else is in the
    batch (on the CPU, so a seed gives the same tokens on every device); None when unseeded:
    it then draws from the sampler's shared one."""
    return None if params.seed is None else make_generator(params.seed)
