"""`POST /v1/completions`: text in, text out, one engine request per prompt.

A request may carry a batch of prompts and ask for `n` completions of each; choice
`prompt_index * n + i` is completion i of that prompt, as in OpenAI and vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from minivllm.entrypoints.openai.protocol import (
    CompletionChoice,
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
    merge_streams,
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
        return self.start(
            request.model,
            "cmpl",
            engine_prompts(request.prompt),
            request.sampling_params(),
            request.priority,
        )

    async def respond(self, started: StartedRequest) -> CompletionResponse:
        outputs = await final_outputs(started.streams)
        choices = [
            self.choice(
                started, i, completion, ChoiceProgress().advance(completion, started.params)
            )
            for i, output in enumerate(outputs)
            for completion in output.outputs
        ]
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
                choice_progress = progress[i][completion.index]
                if choice_progress.finished:
                    continue
                chars_before = choice_progress.chars_sent
                delta = choice_progress.advance(completion, params)
                if delta.token_end > delta.token_start or choice_progress.finished:
                    choice = self.choice(started, i, completion, delta, chars_before)
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
        completion: CompletionOutput,
        delta: Delta,
        text_offset: int = 0,
    ) -> CompletionChoice:
        params = started.params
        logprobs = None
        if params.logprobs is not None and completion.logprobs is not None:
            logprobs = completion_logprobs(
                completion, delta.token_start, delta.token_end, params.logprobs, text_offset
            )
        return CompletionChoice(
            index=prompt_index * params.n + completion.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
