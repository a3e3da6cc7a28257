"""`POST /v1/chat/completions`: a conversation in, the assistant's next message out.

The messages are formatted with the model's own chat template (`tokenizer.apply_chat_template`,
as `LLM.chat` does) and the engine completes the token ids. A stream opens each choice with the
assistant's role, then sends the content as it grows.

Tools, as vLLM serves them without a tool parser: their definitions go into the chat template;
`tool_choice` "required" or a named function makes the answer a JSON document fitting the
tools' schema (chapter 10's structured outputs), which is returned as `tool_calls` rather than
as content. A stream sends each choice's tool calls whole, in the chunk that ends the choice.
With "required", `parallel_tool_calls: false` allows one call; otherwise any number of
distinct calls: an answer that repeats a call ends before the repeat, and one cut short by
max_tokens returns the calls it completed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from minivllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
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
    prompt_logprobs_response,
    raise_if_failed,
    sse,
    usage_counts,
)
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.tokenizer import apply_chat_template


class OpenAIServingChat(OpenAIServing):
    def chat_prompt_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The conversation as token ids, through the model's chat template."""
        return apply_chat_template(
            self.engine.tokenizer,
            [message.as_template_message() for message in messages],
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
        )

    def start_request(self, request: ChatCompletionRequest) -> StartedRequest:
        request.check_supported()
        params = request.sampling_params(self.sampling_defaults)
        prompt_ids = self.chat_prompt_ids(
            request.messages,
            request.add_generation_prompt,
            request.template_tools(),
            request.chat_template_kwargs,
        )
        return self.start(
            request.model, "chatcmpl", [{"prompt_token_ids": prompt_ids}], params, request.priority
        )

    async def respond(
        self, request: ChatCompletionRequest, started: StartedRequest
    ) -> ChatCompletionResponse:
        (output,) = await final_outputs(self.outputs(request, started), 1)
        choices = []
        for completion in output.outputs:
            raise_if_failed(completion)
            delta = ChoiceProgress().advance(completion, started.params)
            tool_calls = answer_tool_calls(request, delta.text)
            message = AssistantMessage(content=delta.text)
            if tool_calls is not None:
                message = AssistantMessage(content="", tool_calls=tool_calls)
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self.logprobs(started, completion, delta),
                    finish_reason=finish_reason(request, completion, tool_calls),
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=started.request_id,
            created=started.created,
            model=started.model,
            choices=choices,
            usage=UsageInfo.of(*usage_counts([output])),
            prompt_logprobs=prompt_logprobs_response(output),
        )

    async def stream(
        self, request: ChatCompletionRequest, started: StartedRequest
    ) -> AsyncIterator[str]:
        params = started.params
        # The first chunk of every choice says who speaks, one chunk per choice, as OpenAI's
        # and vLLM's streams do.
        for i in range(params.n):
            role = DeltaMessage(role="assistant", content="")
            yield sse(self.chunk(started, [ChatCompletionStreamChoice(index=i, delta=role)]))
        progress = [ChoiceProgress() for _ in range(params.n)]
        finished: list[RequestOutput] = []
        async for _, output in self.outputs(request, started):
            for completion in output.outputs:
                raise_if_failed(completion)
                choice_progress = progress[completion.index]
                if choice_progress.finished:
                    continue
                delta = choice_progress.advance(completion, params)
                if request.calls_tools and not choice_progress.finished:
                    continue  # the tool calls are sent whole, once the choice is complete
                if delta.token_end > delta.token_start or choice_progress.finished:
                    choice = self.stream_choice(request, started, completion, delta)
                    yield sse(self.chunk(started, [choice]))
            if output.finished:
                finished.append(output)
        if request.include_usage:
            yield sse(self.chunk(started, [], UsageInfo.of(*usage_counts(finished))))
        yield sse("[DONE]")

    def outputs(
        self, request: ChatCompletionRequest, started: StartedRequest
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        outputs = merge_streams(started.streams)
        if request.effective_tool_choice == "required":
            return without_repeated_calls(outputs)
        return outputs

    def stream_choice(
        self,
        request: ChatCompletionRequest,
        started: StartedRequest,
        completion: CompletionOutput,
        delta: Delta,
    ) -> ChatCompletionStreamChoice:
        tool_calls = None
        message = DeltaMessage(content=delta.text)
        if request.calls_tools:
            tool_calls = answer_tool_calls(request, completion.text)
            if tool_calls is not None:
                message = DeltaMessage(tool_calls=stream_tool_calls(tool_calls))
            else:
                message = DeltaMessage(content=completion.text)
        return ChatCompletionStreamChoice(
            index=completion.index,
            delta=message,
            logprobs=None if request.calls_tools else self.logprobs(started, completion, delta),
            finish_reason=finish_reason(request, completion, tool_calls),
            stop_reason=completion.stop_reason,
        )

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


# --- tool calls ----------------------------------------------------------------------------------


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def answer_tool_calls(request: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The answer of a forced tool call as `tool_calls`: a named function's arguments are the
    whole text; "required" answers a JSON array of {"name", "parameters"}, of which an answer
    cut short (max_tokens) gives the calls it completed. None when the request calls no
    tools, or when no call is complete (then the text is the content)."""
    choice = request.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        return [
            ToolCall(
                id=tool_call_id(), function=FunctionCall(name=choice.function.name, arguments=text)
            )
        ]
    if choice != "required":
        return None
    calls = first_distinct(complete_calls(text))
    if not calls:
        return None
    return [
        ToolCall(
            id=tool_call_id(),
            function=FunctionCall(
                name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False)
            ),
        )
        for call in calls
    ]


def complete_calls(text: str) -> list[dict]:
    """The complete calls at the start of a "required" answer: its grammar makes the text a
    prefix of a JSON array of calls, and an answer cut short ends inside one (dropped)."""
    decoder, calls = json.JSONDecoder(), []
    position = len(text) - len(text.lstrip())
    if not text.startswith("[", position):
        return calls
    position += 1
    while True:
        try:
            call, position = decoder.raw_decode(text, _after_space(text, position))
        except json.JSONDecodeError:
            return calls
        calls.append(call)
        position = _after_space(text, position)
        if not text.startswith(",", position):
            return calls  # "]", or the text ends
        position += 1


def _after_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def first_distinct(calls: list[dict]) -> list[dict]:
    """The calls before the first one that repeats an earlier call."""
    for position, call in enumerate(calls):
        if call in calls[:position]:
            return calls[:position]
    return calls


async def without_repeated_calls(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """A "required" answer ended at its first repeated call. The grammar admits any number of
    calls, and a model may repeat one until max_tokens (greedy decoding of a small model
    does); a second identical call asks for nothing the first did not, so the choice ends
    before it ("stop": its calls are the distinct ones before), as if the array had closed
    there. Once every choice has ended, the streams are closed (aborting what still runs).

    The engine can run ahead of this reader and finish a choice (at max_tokens, or closing the
    array) before its repeat is read: that choice is cut all the same, so the answer does not
    depend on timing. Only its usage does (the tokens the engine generated meanwhile)."""
    ended: dict[int, CompletionOutput] = {}
    try:
        async for index, output in outputs:
            completions = []
            for completion in output.outputs:
                cuttable = completion.finish_reason in (None, "stop", "length")
                if completion.index not in ended and cuttable:
                    calls = complete_calls(completion.text)
                    distinct = first_distinct(calls)
                    if len(distinct) < len(calls):
                        text = json.dumps(distinct, ensure_ascii=False)
                        ended[completion.index] = replace(
                            completion, text=text, finish_reason="stop"
                        )
                completions.append(ended.get(completion.index, completion))
            finished = output.finished or all(c.finish_reason for c in completions)
            yield index, replace(output, outputs=completions, finished=finished)
            if finished:
                return
    finally:
        await outputs.aclose()


def stream_tool_calls(tool_calls: list[ToolCall]) -> list[DeltaToolCall]:
    return [
        DeltaToolCall(index=i, id=call.id, type="function", function=call.function)
        for i, call in enumerate(tool_calls)
    ]


def finish_reason(
    request: ChatCompletionRequest, completion: CompletionOutput, tool_calls: list | None
) -> str | None:
    """vLLM's (and OpenAI's) rule: "tool_calls" when tool_choice "required" made its calls;
    a named function's call ends with "stop"."""
    required = request.effective_tool_choice == "required"
    if required and tool_calls is not None and completion.finish_reason == "stop":
        return "tool_calls"
    return completion.finish_reason
