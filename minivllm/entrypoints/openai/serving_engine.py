"""What the completion and chat endpoints share: errors in OpenAI's shape, the model name check,
opening one engine request per prompt, merging their streams, cutting a growing output into
the deltas a stream sends, and logprobs in OpenAI's two formats.

An error never reaches the client as anything but OpenAI's JSON: before a response starts it
is the response (400 for a bad value, naming the field; 500 for a failure of ours); once a
stream has started it is sent as one `data: {"error": ...}` event, then `data: [DONE]`, as
vLLM's stream generators do.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from minivllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from minivllm.entrypoints.openai.protocol import (
    MIN_LOGPROB,
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    now,
)
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sample.sampling_params import SamplingParams
from minivllm.tokenizer import REPLACEMENT_CHAR, possible_stop_prefix_len

logger = logging.getLogger(__name__)

# A message such as "top_p must be > 0 and <= 1, got 0.0" names its field first.
FIELD_IN_MESSAGE = re.compile(r"^(\w+) must ")

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


def as_openai_error(error: Exception) -> OpenAIError:
    """The client-facing form of any error: a bad value is a 400 naming its field (vLLM
    answers ValueError with 400 too), a busy or dead engine a 503, anything else a 500."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        match = FIELD_IN_MESSAGE.match(str(error))
        param = getattr(error, "param", None) or (match.group(1) if match else None)
        return OpenAIError(400, str(error), param=param)
    if isinstance(error, (EngineOverloadedError, EngineDeadError)):
        return OpenAIError(503, str(error))
    logger.error("internal server error", exc_info=error)
    return OpenAIError(500, f"Internal server error: {type(error).__name__}: {error}")


def raise_if_failed(completion: CompletionOutput) -> None:
    """A request the engine ended with finish_reason "error" is a 500 with the engine's
    message (vLLM: "Internal server error"); the engine itself keeps serving."""
    if completion.finish_reason == "error":
        reason = getattr(completion, "error", None) or "the request failed in the engine"
        raise OpenAIError(500, f"Internal server error: {reason}")


async def with_error_event(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """A stream's events; if making them fails, one error event and `[DONE]` end the stream,
    so the client learns why (the response status, 200, was sent with the first event)."""
    try:
        async for event in events:
            yield event
    except Exception as error:
        yield sse(as_openai_error(error).response())
        yield sse("[DONE]")
    finally:
        await events.aclose()  # its cleanup aborts the requests still running


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
    echo: bool = False  # completions: the prompt goes in front of the answer
    echo_only: bool = False  # ... and the one token generated is dropped (max_tokens=0)


class OpenAIServing:
    """The engine, the names it is served under and the sampling defaults of the model's
    generation config (applied to fields a request leaves out), for the endpoint classes."""

    def __init__(
        self,
        engine: AsyncLLM,
        model_names: list[str],
        sampling_defaults: dict[str, Any] | None = None,
    ):
        self.engine = engine
        self.model_names = model_names
        self.sampling_defaults = sampling_defaults or {}

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary, which token ids must be in (it may be padded past the
        tokenizer's entries)."""
        return self.engine.client.processor.vocab_size

    def decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

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
    iterator (client gone) closes every stream, which aborts what is still running.

    The queue holds at most one item per stream and a pump waits for room before it reads its
    stream again: a client that stops reading leaves each stream holding its newest output
    (streams merge what was not taken yet), instead of a copy per step piling up here."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, done))
        except Exception as error:
            await queue.put((index, error))

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


async def final_outputs(
    outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int
) -> list[RequestOutput]:
    """Each request's finished output, in prompt order, from `merge_streams`' pairs."""
    last: dict[int, RequestOutput] = {}
    async for index, output in outputs:
        last[index] = output
    return [last[index] for index in range(num_prompts)]


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


# --- logprobs ---------------------------------------------------------------------------------


def logprob_value(logprob: float) -> float:
    """A logprob JSON can carry: -inf and NaN (a penalty can overflow the logits) become
    vLLM's floor, -9999.0, never a value the JSON encoder refuses."""
    if math.isnan(logprob) or math.isinf(logprob):
        return MIN_LOGPROB
    return max(logprob, MIN_LOGPROB)


def _top(entries: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The num_top most likely candidates, best first (the sampled token may rank lower)."""
    ranked = sorted(
        (item for item in entries.items() if item[1].rank is not None), key=lambda i: i[1].rank
    )
    return ranked[:num_top]


# One position of a completion's logprobs: the token, and its candidates (None for the
# prompt's first token, which nothing predicts).
TokenStep = tuple[int, dict[int, Logprob] | None]


def output_steps(completion: CompletionOutput, start: int, end: int) -> list[TokenStep]:
    return list(zip(completion.token_ids[start:end], completion.logprobs[start:end]))


def prompt_steps(output: RequestOutput) -> list[TokenStep]:
    candidates = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    return list(zip(output.prompt_token_ids, candidates))


def completion_logprobs(
    steps: list[TokenStep], num_top: int, text_offset: int, decode: Callable[[int], str]
) -> CompletionLogProbs:
    """The completions endpoint's format: parallel lists of tokens, their logprobs, the
    candidates as {token: logprob} (the chosen token and the num_top best, so up to
    num_top + 1 entries, as in OpenAI and vLLM), and where each token starts in the text."""
    result = CompletionLogProbs()
    for token_id, entries in steps:
        if entries is None:
            token, token_logprob, top = decode(token_id), None, None
        else:
            chosen = entries[token_id]
            token = _token_text(token_id, chosen, decode)
            token_logprob = logprob_value(chosen.logprob)
            top = {token: token_logprob}
            for candidate_id, entry in _top(entries, num_top):
                top.setdefault(
                    _token_text(candidate_id, entry, decode), logprob_value(entry.logprob)
                )
        result.tokens.append(token)
        result.token_logprobs.append(token_logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def _token_text(token_id: int, entry: Logprob, decode: Callable[[int], str]) -> str:
    return entry.decoded_token if entry.decoded_token is not None else decode(token_id)


def joined_logprobs(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def prompt_logprobs_response(output: RequestOutput) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` field, with the values JSON can carry."""
    if output.prompt_logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            token_id: PromptLogprob(
                logprob=logprob_value(entry.logprob),
                rank=entry.rank,
                decoded_token=entry.decoded_token,
            )
            for token_id, entry in entries.items()
        }
        for entries in output.prompt_logprobs
    ]


def chat_logprobs(
    completion: CompletionOutput, start: int, end: int, num_top: int
) -> ChatChoiceLogprobs:
    """The chat endpoint's format for tokens [start, end): one entry per token with its
    top candidates (only the most likely ones, as in OpenAI), each with its UTF-8 bytes."""
    content = []
    for token_id, entries in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        sampled = entries[token_id]
        top = [_top_logprob(entry) for _, entry in _top(entries, num_top)]
        content.append(ChatTokenLogprob(**_top_logprob(sampled).model_dump(), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _top_logprob(entry: Logprob) -> TopLogprob:
    token = entry.decoded_token or ""
    return TopLogprob(token=token, logprob=logprob_value(entry.logprob), bytes=list(token.encode()))
