"""What the completion and chat endpoints share: errors in OpenAI's shape, the model name check,
opening one engine request per prompt, merging their streams, cutting a growing output into
the deltas a stream sends, and logprobs in OpenAI's two formats.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from pydantic import BaseModel
from starlette.requests import Request

from minivllm.engine.async_llm import AsyncLLM, RequestStream
from minivllm.entrypoints.openai.protocol import (
    MIN_LOGPROB,
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    ErrorInfo,
    ErrorResponse,
    TopLogprob,
    now,
)
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sample.sampling_params import SamplingParams
from minivllm.tokenizer import REPLACEMENT_CHAR, possible_stop_prefix_len

# OpenAI's error "type" for each status the server answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "client_closed_request",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error the client is told about, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> ErrorResponse:
        info = ErrorInfo(
            message=self.message,
            type=ERROR_TYPES.get(self.status, "error"),
            param=self.param,
            code=self.status,
        )
        return ErrorResponse(error=info)


def sse(payload: BaseModel | str) -> str:
    """One server-sent event; `data: [DONE]` ends an OpenAI stream."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


@dataclass
class StartedRequest:
    """A request the engine accepted: one stream per prompt."""

    model: str  # the name to answer with
    request_id: str
    params: SamplingParams
    streams: list[RequestStream]
    created: int = field(default_factory=now)


class OpenAIServing:
    """The engine and the names it is served under, for the endpoint classes."""

    def __init__(self, engine: AsyncLLM, model_names: list[str]):
        self.engine = engine
        self.model_names = model_names

    def check_model(self, model: str | None) -> str:
        """The model name to answer with; an unknown one is a 404, as in OpenAI and vLLM."""
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model")
        return model

    def start(
        self,
        model: str | None,
        id_prefix: str,
        prompts: list,
        params: SamplingParams,
        priority: int,
    ) -> StartedRequest:
        """Queue one engine request per prompt. Every error is raised here, before a response
        starts; if one prompt is refused, those already queued are aborted, so a failed request
        leaves nothing running."""
        started = StartedRequest(
            self.check_model(model), f"{id_prefix}-{uuid.uuid4().hex}", params, []
        )
        try:
            for index, prompt in enumerate(prompts):
                started.streams.append(
                    self.engine.add_request(
                        f"{started.request_id}-{index}", prompt, params, priority=priority
                    )
                )
        except BaseException:
            for stream in started.streams:
                stream.close()
            raise
        return started


async def merge_streams(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams, as the outputs arrive. Closing the merged
    iterator (client gone) closes every stream, which aborts what is still running."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, done))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each request's finished output, in prompt order."""
    last: dict[int, RequestOutput] = {}
    async for index, output in merge_streams(streams):
        last[index] = output
    return [last[index] for index in range(len(streams))]


async def cancel_on_disconnect(raw_request: Request, work: Awaitable):
    """Await `work`, cancelling it if the client disconnects first (its requests are then
    aborted by their streams' cleanup). Returns None in that case."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
    await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not work_task.done():
        work_task.cancel()
        return None
    return work_task.result()


async def wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def usage_counts(outputs: list[RequestOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens): each prompt once, every completion's tokens."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return prompt_tokens, completion_tokens


# --- streaming deltas ----------------------------------------------------------------------------


@dataclass
class Delta:
    text: str
    token_start: int  # the new tokens are token_ids[token_start:token_end]
    token_end: int


@dataclass
class ChoiceProgress:
    """What a stream has already sent of one choice."""

    chars_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False

    def advance(self, completion: CompletionOutput, params: SamplingParams) -> Delta:
        """The text and tokens not sent yet, holding back text that may still change."""
        end = max(streamable_text_end(completion, params), self.chars_sent)
        delta = Delta(completion.text[self.chars_sent : end], self.tokens_sent, 0)
        delta.token_end = len(completion.token_ids)
        self.chars_sent, self.tokens_sent = end, delta.token_end
        self.finished = completion.finish_reason is not None
        return delta


def streamable_text_end(completion: CompletionOutput, params: SamplingParams) -> int:
    """How much of a growing output text is final. Until the sequence ends, a trailing half
    character ("\\ufffd") may still be completed, and a tail that starts a stop string may still
    be cut away, so neither is sent yet (the tokenizer's IncrementalDetokenizer rule)."""
    text = completion.text
    if completion.finish_reason is not None:
        return len(text)
    text = text.rstrip(REPLACEMENT_CHAR)
    if params.include_stop_str_in_output:
        return len(text)
    return len(text) - possible_stop_prefix_len(text, params.stop)


# --- logprobs ------------------------------------------------------------------------------------


def _top(entries: dict[int, Logprob], num_top: int) -> list[Logprob]:
    """The num_top most likely candidates, best first (the sampled token may rank lower)."""
    ranked = sorted(
        (entry for entry in entries.values() if entry.rank is not None), key=lambda e: e.rank
    )
    return ranked[:num_top]


def _value(entry: Logprob) -> float:
    return max(entry.logprob, MIN_LOGPROB)


def completion_logprobs(
    completion: CompletionOutput, start: int, end: int, num_top: int, text_offset: int
) -> CompletionLogProbs:
    """The completions endpoint's format for tokens [start, end): parallel lists of tokens,
    their logprobs, the top candidates as {token: logprob}, and where each token starts."""
    result = CompletionLogProbs()
    for token_id, entries in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        sampled = entries[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(_value(sampled))
        result.top_logprobs.append(
            {e.decoded_token or "": _value(e) for e in _top(entries, num_top)}
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(
    completion: CompletionOutput, start: int, end: int, num_top: int
) -> ChatChoiceLogprobs:
    """The chat endpoint's format for tokens [start, end): one entry per token with its
    top candidates, each with the UTF-8 bytes of its text."""
    content = []
    for token_id, entries in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        sampled = entries[token_id]
        top = [_top_logprob(entry) for entry in _top(entries, num_top)]
        content.append(ChatTokenLogprob(**_top_logprob(sampled).model_dump(), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _top_logprob(entry: Logprob) -> TopLogprob:
    token = entry.decoded_token or ""
    return TopLogprob(token=token, logprob=_value(entry), bytes=list(token.encode()))
