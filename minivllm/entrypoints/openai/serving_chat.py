"""`POST /v1/chat/completions`: a conversation in, the assistant's next message out.

The messages are formatted with the model's own chat template (`tokenizer.apply_chat_template`,
as `LLM.chat` does) and the engine completes the token ids. A stream opens each choice with the
assistant's role, then sends the content as it grows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from minivllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from minivllm.entrypoints.openai.serving_engine import (
    ChoiceProgress,
    Delta,
    OpenAIServing,
    StartedRequest,
    chat_logprobs,
    final_outputs,
    merge_streams,
    sse,
    usage_counts,
)
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.tokenizer import apply_chat_template


class OpenAIServingChat(OpenAIServing):
    def chat_prompt_ids(
        self, messages: list[ChatMessage], add_generation_prompt: bool
    ) -> list[int]:
        """The conversation as token ids, through the model's chat template."""
        return apply_chat_template(
            self.engine.tokenizer,
            [message.as_template_message() for message in messages],
            add_generation_prompt=add_generation_prompt,
        )

    def start_request(self, request: ChatCompletionRequest) -> StartedRequest:
        params = request.sampling_params()
        prompt_ids = self.chat_prompt_ids(request.messages, request.add_generation_prompt)
        return self.start(
            request.model, "chatcmpl", [{"prompt_token_ids": prompt_ids}], params, request.priority
        )

    async def respond(self, started: StartedRequest) -> ChatCompletionResponse:
        (output,) = await final_outputs(started.streams)
        choices = []
        for completion in output.outputs:
            delta = ChoiceProgress().advance(completion, started.params)
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=AssistantMessage(content=delta.text),
                    logprobs=self.logprobs(started, completion, delta),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=started.request_id,
            created=started.created,
            model=started.model,
            choices=choices,
            usage=UsageInfo.of(*usage_counts([output])),
        )

    async def stream(
        self, request: ChatCompletionRequest, started: StartedRequest
    ) -> AsyncIterator[str]:
        params = started.params
        # The first chunk of every choice says who speaks, as OpenAI's streams do.
        yield sse(
            self.chunk(
                started,
                [
                    ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    )
                    for i in range(params.n)
                ],
            )
        )
        progress = [ChoiceProgress() for _ in range(params.n)]
        finished: list[RequestOutput] = []
        async for _, output in merge_streams(started.streams):
            for completion in output.outputs:
                choice_progress = progress[completion.index]
                if choice_progress.finished:
                    continue
                delta = choice_progress.advance(completion, params)
                if delta.token_end > delta.token_start or choice_progress.finished:
                    choice = ChatCompletionStreamChoice(
                        index=completion.index,
                        delta=DeltaMessage(content=delta.text),
                        logprobs=self.logprobs(started, completion, delta),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    yield sse(self.chunk(started, [choice]))
            if output.finished:
                finished.append(output)
        if request.include_usage:
            yield sse(self.chunk(started, [], UsageInfo.of(*usage_counts(finished))))
        yield sse("[DONE]")

    def chunk(
        self,
        started: StartedRequest,
        choices: list[ChatCompletionStreamChoice],
        usage: UsageInfo | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=started.request_id,
            created=started.created,
            model=started.model,
            choices=choices,
            usage=usage,
        )

    def logprobs(self, started: StartedRequest, completion: CompletionOutput, delta: Delta):
        num_top = started.params.logprobs
        if num_top is None or completion.logprobs is None:
            return None
        return chat_logprobs(completion, delta.token_start, delta.token_end, num_top)
