"""The offline API, `LLM`: vLLM's entry point, with the same names and shapes.

    from minivllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outputs[0].outputs[0].text)

`LLM` is a thin loop around `LLMEngine` (chapter 04): validate every prompt, add them all as
requests, call `step()` until none is left, and return the finished outputs in input order.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

from tqdm.auto import tqdm

from minivllm.config import EngineConfig
from minivllm.engine import make_engine
from minivllm.engine.llm_engine import Metric
from minivllm.engine.processor import broadcast_params
from minivllm.outputs import RequestOutput
from minivllm.sample.sampling_params import SamplingParams
from minivllm.tokenizer import apply_chat_template


class LLM:
    """Load a model once, then generate for batches of prompts.

    `model` is a local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct);
    the other keyword arguments are the engine settings of `EngineConfig` (config.py), with
    vLLM's names: dtype, device, seed, block_size, max_num_seqs, max_num_batched_tokens,
    max_model_len, kv_cache_memory_bytes, gpu_memory_utilization, scheduling_policy,
    enable_chunked_prefill, enable_prefix_caching, attention_backend, data_parallel_size,
    logprobs_mode, quantization (chapter 12: a dtype its kernels are not fast for is a
    ValueError). An unknown one raises TypeError.

    With data_parallel_size=M > 1 the engine is a `DataParallelEngine` (chapter 07): M engine
    replicas, each in its own process, behind the same calls (a script then needs the
    `if __name__ == "__main__":` guard, as replicas start with multiprocessing's "spawn").
    """

    def __init__(self, model: str | os.PathLike | None = None, **engine_settings: Any):
        config = EngineConfig.from_kwargs(
            model=None if model is None else str(model), **engine_settings
        )
        self.llm_engine = make_engine(config)
        self._request_counter = itertools.count()

    @property
    def model_path(self):
        return self.llm_engine.model_path

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False while requests are running."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (KV-cache usage, running/waiting requests, preemptions, token
        counts), under vLLM's names."""
        return self.llm_engine.get_metrics()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; results come back in the order of `prompts`."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        params_per_prompt = broadcast_params(sampling_params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        # Validate everything before queuing anything: one bad prompt must leave no work behind.
        processor = self.llm_engine.processor
        processed = [
            processor.process_request(prompt, params)[0]
            for prompt, params in zip(prompts, params_per_prompt)
        ]

        request_ids = [str(next(self._request_counter)) for _ in prompts]
        for request_id, prompt, params, prio in zip(
            request_ids, processed, params_per_prompt, priorities
        ):
            self.llm_engine.add_request(request_id, prompt.as_prompt(), params, priority=prio)
        return self._run_engine(request_ids, use_tqdm)

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
        is_batch = (
            isinstance(messages, (list, tuple))
            and bool(messages)
            and isinstance(messages[0], (list, tuple))
        )
        conversations = messages if is_batch else [messages]
        tokenizer = self.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    tokenizer, c, add_generation_prompt=add_generation_prompt
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        finally:
            progress.close()
            # Interrupted (Ctrl-C, an error): abort what is left so every block goes back.
            self.llm_engine.abort_request([rid for rid in request_ids if rid not in finished])
        return [finished[rid] for rid in request_ids]
