"""The OpenAI wire format: requests and responses of the endpoints, as pydantic models.

Field names, defaults and shapes are OpenAI's (and vLLM's extras, such as `top_k` or
`ignore_eos`), so the official `openai` client, and any tool written for OpenAI or vLLM, talks
to minivllm unchanged. Pydantic checks the types; the values are checked by `SamplingParams`,
whose errors name the field, so both become a 400 with a message the user can act on.

Chapter 10 adds the form of the output, in either dialect: OpenAI's `response_format` (a JSON
schema, or any JSON object) or vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object), both mapped onto `SamplingParams.structured_outputs`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minivllm.sample.sampling_params import SamplingParams, StructuredOutputsParams

# JSON has no -inf; a token the model rules out gets this log-probability instead (vLLM's value).
MIN_LOGPROB = -9999.0


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as OpenAI's clients send fields a server may not know.
    model_config = ConfigDict(extra="ignore")


# --- errors --------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --- requests ------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    # OpenAI's key is "schema", which is also the name of a pydantic method: hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    # OpenAI's strict mode guarantees the schema; a grammar always does, so it changes nothing.
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that fits a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema: {"name", "schema"}')
        return self

    def as_structured_outputs(self) -> StructuredOutputsParams | None:
        """The same constraint in vLLM's terms; None for free text."""
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class SamplingRequest(OpenAIBaseModel):
    """The fields both generation endpoints share, and their translation to SamplingParams."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # chapter 10: the form of the output, OpenAI's way or vLLM's (pydantic fills the dataclass
    # and runs its checks, so a malformed one is a 400 naming structured_outputs)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request as SamplingParams; invalid values raise its ValueError naming the field."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.output_form(),
        )

    def output_form(self) -> StructuredOutputsParams | None:
        """The constraint on the output, from whichever of the two fields sets one."""
        from_format = self.response_format and self.response_format.as_structured_outputs()
        if from_format is not None and self.structured_outputs is not None:
            raise ValueError(
                "response_format must be text when structured_outputs is set: give the form of "
                "the output in one of them"
            )
        return from_format or self.structured_outputs


class CompletionRequest(SamplingRequest):
    # One prompt or a batch: a string, a list of strings, token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        return self.to_sampling_params(self.max_tokens, self.logprobs)


class TextContent(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextContent] | None = None

    def as_template_message(self) -> dict[str, str]:
        """{"role", "content"} with the content as one string, as chat templates expect."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: as many as the context leaves
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.to_sampling_params(max_tokens, logprobs)


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# --- responses -----------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token that ended it


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "minivllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
