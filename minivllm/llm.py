"""The offline API, `LLM`: vLLM's entry point, with the same names and shapes.

    from minivllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outputs[0].outputs[0].text)

`LLM` loads the model and tokenizer, turns prompts into validated requests (`Processor`) and
runs them on an engine. Here the engine is chapter 02's static batching: requests run in
batches of up to `max_num_seqs`, each batch until its longest member ends.
"""

from __future__ import annotations

import itertools
import os

import torch
from tqdm.auto import tqdm

from minivllm.config import resolve_device, resolve_dtype
from minivllm.kv_cache import generate_static_batch
from minivllm.model_loader import load_model, load_tokenizer, resolve_model_path
from minivllm.outputs import RequestOutput
from minivllm.processor import Processor, broadcast_params
from minivllm.request import Request
from minivllm.sampling import Sampler, SamplingParams, make_generator
from minivllm.tokenizer import apply_chat_template


class LLM:
    """Load a model once, then generate for batches of prompts."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        seed: int = 0,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
    ):
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_path = resolve_model_path(model)
        self.model = load_model(self.model_path, self.dtype, self.device)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model_config = self.model.config
        self.max_model_len = self.model_config.max_model_len
        if max_model_len is not None:
            if not isinstance(max_model_len, int) or max_model_len < 2:
                raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
            self.max_model_len = min(self.max_model_len, max_model_len)
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = _eos_token_ids(self.model_config.hf_config, self.tokenizer)
        self.processor = Processor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.sampler = Sampler(default_generator=make_generator(seed))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt; results come back in the order of `prompts`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        params_per_prompt = broadcast_params(sampling_params, len(prompts))
        # Validate everything before running anything, so one bad prompt leaves no half-done work.
        processed = [self.processor.process_prompt(p) for p in prompts]
        for prompt, params in zip(processed, params_per_prompt):
            self.processor.check_fits(prompt, params)

        groups = []  # one list of n sequences per prompt
        for prompt, params in zip(processed, params_per_prompt):
            request_id = str(next(self._request_counter))
            groups.append(
                [
                    Request.create(
                        request_id,
                        prompt.text,
                        prompt.token_ids,
                        params,
                        self.tokenizer,
                        self.eos_token_ids,
                        self.max_model_len,
                        index=i,
                    )
                    for i in range(params.n)
                ]
            )
        self._run([r for group in groups for r in group], use_tqdm)
        return [_request_output(group) for group in groups]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them,
        formatted with the model's chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    self.tokenizer, conversation, add_generation_prompt=add_generation_prompt
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        """Static batches of up to max_num_seqs sequences, in order."""
        progress = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm)
        for start in range(0, len(requests), self.max_num_seqs):
            batch = requests[start : start + self.max_num_seqs]
            generate_static_batch(self.model, batch, self.sampler)
            progress.update(len(batch))
        progress.close()


def _request_output(sequences: list[Request]) -> RequestOutput:
    first = sequences[0]
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[s.completion_output() for s in sequences],
        finished=all(s.is_finished for s in sequences),
        metrics=first.metrics,
    )


def _eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    """EOS ids from the model config (an int or a list) and the tokenizer, deduplicated."""
    ids = getattr(hf_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))

