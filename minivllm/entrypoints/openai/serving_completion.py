"""`POST /v1/completions`: text in, text out, one engine request per prompt.

A request may carry a batch of prompts and ask for `n` completions of each; choice
`prompt_index * n + i` is completion i of that prompt, as in OpenAI and vLLM.

With `echo` the prompt comes back in front of the answer, and with `logprobs` so do the
prompt's logprobs (the first token's null: nothing predicts it). That is how evaluation
harnesses such as lm-eval score a continuation: `max_tokens` 1 (or 0, the prompt alone),
`echo`, `logprobs` 1, and the sum of the continuation's token logprobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from minivllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from minivllm.entrypoints.openai.serving_engine import (
    ChoiceProgress,
    Delta,
    OpenAIServing,
    StartedRequest,
    completion_logprobs,
    final_outputs,
    joined_logprobs,
    merge_streams,
    output_steps,
    prompt_logprobs_response,
    prompt_steps,
    raise_if_failed,
    sse,
    usage_counts,
)
from minivllm.outputs import CompletionOutput, RequestOutput


def engine_prompts(prompt) -> list:
    """The request's `prompt` field as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt is empty; give a string, a list of strings or token ids")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class OpenAIServingCompletion(OpenAIServing):
    def start_request(self, request: CompletionRequest) -> StartedRequest:
        request.check_supported()
        started = self.start(
            request.model,
            "cmpl",
            engine_prompts(request.prompt),
            request.sampling_params(self.sampling_defaults),
            request.priority,
        )
        started.echo, started.echo_only = request.echo, request.echo_only
        return started

    async def respond(
        self, request: CompletionRequest, started: StartedRequest
    ) -> CompletionResponse:
        outputs = await final_outputs(merge_streams(started.streams), len(started.streams))
        choices = []
        for i, output in enumerate(outputs):
            for completion in output.outputs:
                raise_if_failed(completion)
                delta = ChoiceProgress().advance(completion, started.params)
                choice = self.choice(started, i, output, completion, delta, 0, True)
                choice.prompt_logprobs = prompt_logprobs_response(output)
                choices.append(choice)
        usage = UsageInfo.of(*usage_counts(outputs))
        return self.response(started, choices, usage)

    async def stream(
        self, request: CompletionRequest, started: StartedRequest
    ) -> AsyncIterator[str]:
        params = started.params
        progress = [[ChoiceProgress() for _ in range(params.n)] for _ in started.streams]
        finished: list[RequestOutput] = []
        async for i, output in merge_streams(started.streams):
            for completion in output.outputs:
                raise_if_failed(completion)
                choice_progress = progress[i][completion.index]
                if choice_progress.finished:
                    continue
                chars_before = choice_progress.chars_sent
                first = choice_progress.tokens_sent == 0
                delta = choice_progress.advance(completion, params)
                if delta.token_end > delta.token_start or choice_progress.finished:
                    choice = self.choice(started, i, output, completion, delta, chars_before, first)
                    yield sse(self.response(started, [choice]))
            if output.finished:
                finished.append(output)
        if request.include_usage:
            yield sse(self.response(started, [], UsageInfo.of(*usage_counts(finished))))
        yield sse("[DONE]")

    def response(
        self,
        started: StartedRequest,
        choices: list[CompletionChoice],
        usage: UsageInfo | None = None,
    ) -> CompletionResponse:
        return CompletionResponse(
            id=started.request_id,
            created=started.created,
            model=started.model,
            choices=choices,
            usage=usage,
        )

    def choice(
        self,
        started: StartedRequest,
        prompt_index: int,
        output: RequestOutput,
        completion: CompletionOutput,
        delta: Delta,
        text_offset: int,
        first: bool,
    ) -> CompletionChoice:
        """The choice for `delta`. When echoing, a choice's first piece (the whole of it when
        not streamed) starts with the prompt, and text offsets count from the prompt's start."""
        params = started.params
        prompt_text = self.prompt_text(output) if started.echo else ""
        text = "" if started.echo_only else delta.text
        logprobs = None
        if params.logprobs is not None and completion.logprobs is not None:
            steps = [] if started.echo_only else output_steps(completion, *delta_range(delta))
            offset = len(prompt_text) + text_offset
            logprobs = completion_logprobs(steps, params.logprobs, offset, self.decode_token)
            if started.echo and first:
                logprobs = joined_logprobs(self.prompt_logprobs(output, params.logprobs), logprobs)
        if started.echo and first:
            text = prompt_text + text
        return CompletionChoice(
            index=prompt_index * params.n + completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids)

    def prompt_logprobs(self, output: RequestOutput, num_top: int) -> CompletionLogProbs:
        return completion_logprobs(prompt_steps(output), num_top, 0, self.decode_token)


def delta_range(delta: Delta) -> tuple[int, int]:
    return delta.token_start, delta.token_end
