"""The OpenAI wire format: requests and responses of the endpoints, as pydantic models.

Field names, defaults and shapes are OpenAI's (and vLLM's extras, such as `top_k` or
`ignore_eos`), so the official `openai` client, and any tool written for OpenAI or vLLM, talks
to minivllm unchanged. Pydantic checks the types; the values are checked by `SamplingParams`,
whose errors name the field, so both become a 400 with a message the user can act on.

Chapter 10 adds the form of the output, in either dialect: OpenAI's `response_format` (a JSON
schema, or any JSON object) or vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object), both mapped onto `SamplingParams.structured_outputs`. Tool calling is built on
the same machinery, as vLLM does it without a tool parser: `tool_choice` "required" or a named
function becomes a JSON schema the answer must fit, and the answer is returned as `tool_calls`.

The models are the schema `/openapi.json` serves, so they say exactly what the server takes:
types are strict (`true` is not a token id, `1.5` not a count, `"yes"` not a boolean), every
bound a validator enforces on one field is declared on it, and the bounds that depend on the
model served (its vocabulary, its context length) are marked here and filled in by the server
(`declare_model_bounds`). What no schema can say (a prompt too long for the context once
tokenized, a regex that does not compile, fields that exclude each other) is a 400 naming
the field. Unknown fields are ignored, as OpenAI's clients send fields a server may not know;
but an OpenAI field that would change the answer and that minivllm does not implement
(`suffix`, `functions`, ...) is declared as `null` only, so that setting it is a 400 naming
it, never silently dropped.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from minivllm.sample.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.tokenizer import RESERVED_TEMPLATE_ARGUMENTS

# JSON has no -inf; a token the model rules out gets this log-probability instead (vLLM's value).
MIN_LOGPROB = -9999.0
# vLLM bounds `seed` to torch's int64 in its request model; a larger one is a 400, not a crash.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's bound on choices per request: without one, a single request for half a million
# choices would occupy the engine for hours.
MAX_CHOICES = 128
# OpenAI's range for a logit bias; vLLM clamps to it.
LOGIT_BIAS_LIMIT = 100.0
# Candidates per token a request may ask for (`logprobs`, `top_logprobs`, `prompt_logprobs`):
# OpenAI's cap, and vLLM's default --max-logprobs. Each one is a sort and a decode per token.
MAX_LOGPROBS = 20

# The key that marks, in the schema, a bound set by the model served (`declare_model_bounds`):
# "vocabulary" (token ids, below the vocabulary size) or "context" (lengths that leave room
# for a prompt in the context).
MODEL_BOUND = "x-model-bound"
# A decimal token id as a string (logit_bias's keys): no sign, no leading zero, no spaces.
TOKEN_ID_STRING = re.compile(r"0|[1-9][0-9]*")


def model_bound(kind: Literal["vocabulary", "context"], **constraints: Any) -> Any:
    return Field(**constraints, json_schema_extra={MODEL_BOUND: kind})


def declare_model_bounds(schema: Any, vocab_size: int, max_model_len: int) -> None:
    """Fill in, in place, the bounds `model_bound` marked in a JSON schema: below the vocabulary
    size for token ids (a number, or the keys of an object), below the context length for
    lengths (a count of tokens a prompt leaves room for, or a number of prompt tokens)."""
    if isinstance(schema, list):
        for item in schema:
            declare_model_bounds(item, vocab_size, max_model_len)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.pop(MODEL_BOUND, None)
    if kind is not None:
        limit = vocab_size if kind == "vocabulary" else max_model_len
        if schema.get("type") == "integer":
            schema["maximum"] = limit - 1
        elif schema.get("type") == "array":
            schema["maxItems"] = limit - 1
        else:  # an object keyed by token ids
            schema["propertyNames"] = {"pattern": f"^({integers_below(limit)})$"}
    for value in schema.values():
        declare_model_bounds(value, vocab_size, max_model_len)


def integers_below(limit: int) -> str:
    """A regular expression for the decimal numbers 0 <= n < limit as TOKEN_ID_STRING writes
    them: a JSON schema can bound a number but not a key, so logit_bias's keys are bounded by
    their digits. For limit 49152: 0, one to four digits, then the five-digit numbers by how
    much of 49151 they share: 1xxxx-3xxxx, 40xxx-48xxx, 490xx, 4910x-4914x, 49150, 49151."""
    top = str(limit - 1)
    alternatives = ["0"]
    if len(top) > 1:
        alternatives.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for position, digit in enumerate(top):  # as long as top: top's first digits, one lower
        lowest, below = (1 if position == 0 else 0), int(digit) - 1
        if below >= lowest:
            lower = str(below) if below == lowest else f"[{lowest}-{below}]"
            alternatives.append(top[:position] + lower + "[0-9]" * (len(top) - position - 1))
    if top != "0":
        alternatives.append(top)
    return "|".join(alternatives)


def _integral(value: Any) -> Any:
    """A float with no fraction as the integer it is: JSON Schema's integers include 1.0 (JSON
    has one kind of number), so the schema's "integer" takes it. A fractional float, a bool or
    a string is left to the strict int, which refuses it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(*constraints: Any) -> Any:
    """An int type with its constraints (`Field(ge=...)`), taking 1.0 as 1 (`_integral`). The
    constraints come before the validator: after it, pydantic could not put them in the
    schema."""
    return Annotated[(int, *constraints, BeforeValidator(_integral))]


Integer = integer()
TokenId = integer(model_bound("vocabulary", ge=0))
NonEmptyStr = Annotated[str, Field(min_length=1)]
# A count of candidates per token.
NumLogprobs = integer(Field(ge=0, le=MAX_LOGPROBS))
NumChoices = integer(Field(ge=1, le=MAX_CHOICES))
# Declared as OpenAPI's int64, which is exactly this range: bounds past 2**53 written as
# numbers are read as doubles by many JSON tools (2**63 - 1 becomes 2**63).
Seed = integer(
    Field(ge=SEED_MIN, le=SEED_MAX), WithJsonSchema({"type": "integer", "format": "int64"})
)
TopK = integer(Field(ge=-1))
MinTokens = integer(Field(ge=0))
# Candidates per prompt token; -1: the whole vocabulary.
PromptLogprobsCount = integer(Field(ge=-1, le=MAX_LOGPROBS))


class RequestFieldError(ValueError):
    """A value the server refuses, naming its field: the 400's `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _refuse_unless_null(value: Any, info: ValidationInfo) -> None:
    if value is not None:
        raise RequestFieldError(info.field_name, f"{info.field_name} is not supported by minivllm")
    return value


# An OpenAI field minivllm does not implement: the schema allows only null, and any other
# value is a 400 naming it.
Unsupported = Annotated[
    None,
    BeforeValidator(_refuse_unless_null),
    Field(description="not supported by minivllm: refused unless null"),
]


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as OpenAI's clients send fields a server may not know; known
    # ones are not coerced (strict), so that a value is accepted exactly when the schema says.
    model_config = ConfigDict(extra="ignore", strict=True)


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


class TextFormat(OpenAIBaseModel):
    type: Literal["text"]

    def as_structured_outputs(self) -> StructuredOutputsParams | None:
        return None


class JsonObjectFormat(OpenAIBaseModel):
    type: Literal["json_object"]

    def as_structured_outputs(self) -> StructuredOutputsParams | None:
        return StructuredOutputsParams(json_object=True)


class JsonSchemaResponseFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    @model_validator(mode="before")
    @classmethod
    def _schema_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and "json_schema" not in data:
            raise RequestFieldError(
                "response_format", 'type "json_schema" needs a json_schema: {"name", "schema"}'
            )
        return data

    def as_structured_outputs(self) -> StructuredOutputsParams | None:
        return StructuredOutputsParams(json=self.json_schema.json_schema)


# OpenAI's `response_format`: free text, any JSON object, or JSON that fits a schema; each
# `as_structured_outputs()` is the same constraint in vLLM's terms (None for free text).
ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]

# The five kinds of vLLM's structured_outputs; the schema says that exactly one is set.
STRUCTURED_OUTPUT_KINDS = {
    "json": {"type": ["string", "object"]},
    "regex": {"type": "string"},
    "choice": {"type": "array"},
    "grammar": {"type": "string"},
    "json_object": {"const": True},
}


class StructuredOutputs(OpenAIBaseModel):
    """vLLM's `structured_outputs` as a request carries it; `params` is the engine's
    `StructuredOutputsParams`, which checks it (exactly one kind set) when the body is read."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": [kind], "properties": {kind: value}}
                for kind, value in STRUCTURED_OUTPUT_KINDS.items()
            ]
        }
    )

    # "json" is also the name of a pydantic method: hence the alias.
    json_spec: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        self.params()
        return self

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**self.model_dump(by_alias=True))


class SamplingRequest(OpenAIBaseModel):
    """The fields both generation endpoints share, and their translation to SamplingParams.
    The bounds are SamplingParams' own (tests/test_served_schema.py checks they agree)."""

    model: str | None = None
    n: NumChoices = 1
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: Seed | None = None
    # {"token id": bias}: the keys are token ids of the vocabulary
    logit_bias: Annotated[dict[str, float], model_bound("vocabulary")] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: TopK | None = None  # -1 or 0: off
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    min_tokens: MinTokens = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Integer = 0
    # top candidates per prompt token (vLLM's extra); -1: the whole vocabulary
    prompt_logprobs: PromptLogprobsCount | None = None
    # chapter 10: the form of the output, OpenAI's way or vLLM's
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Refuse combinations that would otherwise be silently ignored (vLLM's checks and
        messages)."""
        if self.stream_options is not None and not self.stream:
            raise RequestFieldError(
                "stream_options", "Stream options can only be defined when `stream=True`."
            )
        if self.prompt_logprobs is not None and self.stream:
            raise RequestFieldError(
                "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."
            )

    def left_out(self, name: str) -> bool:
        """Whether the request leaves a sampling field to the server's default."""
        return name not in self.model_fields_set or getattr(self, name) is None

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any],
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request as SamplingParams, `defaults` (the model's generation config) filling
        the fields it leaves out; invalid values raise a ValueError naming the field."""
        values = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
        )
        values.update({name: v for name, v in defaults.items() if self.left_out(name)})
        return SamplingParams(
            n=self.n,
            **values,
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.output_form(),
            logit_bias=self.token_logit_bias(),
            prompt_logprobs=prompt_logprobs,
        )

    def token_logit_bias(self) -> dict[int, float] | None:
        """OpenAI's `logit_bias` ({"token id": bias}) with int keys, each bias clamped to
        [-100, 100] as vLLM does (the engine refuses ids outside the vocabulary)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not TOKEN_ID_STRING.fullmatch(key):
                raise RequestFieldError(
                    "logit_bias", f"logit_bias keys must be token ids, got {key!r}"
                )
            bias[int(key)] = min(max(value, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
        return bias

    def output_form(self) -> StructuredOutputsParams | None:
        """The constraint on the output, from whichever of the two fields sets one."""
        from_format = self.response_format and self.response_format.as_structured_outputs()
        if from_format is not None and self.structured_outputs is not None:
            raise ValueError(
                "response_format must be text when structured_outputs is set: give the form of "
                "the output in one of them"
            )
        if from_format is not None:
            return from_format
        return self.structured_outputs and self.structured_outputs.params()


# A prompt as token ids: at least one, and room left in the context for one generated token.
PromptTokenIds = Annotated[list[TokenId], model_bound("context", min_length=1)]
# At most what the context holds after a one-token prompt.
MaxTokens = integer(model_bound("context", ge=1))
# Completions take 0 as well, with echo: the prompt's logprobs alone.
CompletionMaxTokens = integer(model_bound("context", ge=0))


class CompletionRequest(SamplingRequest):
    # One prompt or a batch: a string, a list of strings, token ids, or a list of token-id lists.
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | PromptTokenIds
        | Annotated[list[PromptTokenIds], Field(min_length=1)]
    )
    max_tokens: CompletionMaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    # The prompt in front of the answer, with its logprobs when logprobs are asked for.
    echo: bool = False
    # only best_of == n: minivllm returns every sequence it makes
    best_of: NumChoices | None = None
    suffix: Unsupported = None

    @property
    def echo_only(self) -> bool:
        """max_tokens=0 with echo: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise RequestFieldError(
                "best_of", f"best_of must equal n ({self.n}) or be left out, got {self.best_of}"
            )

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        # vLLM's way for max_tokens=0 with echo: generate one token and drop it.
        max_tokens = 1 if self.echo_only else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self.to_sampling_params(max_tokens, self.logprobs, defaults, prompt_logprobs)


class TextContent(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: NonEmptyStr
    content: str | list[TextContent] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer to one of those calls

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates expect it: the content as one string, and a tool
        call's arguments as a dict (Hugging Face templates render them; vLLM does the same)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_dict(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _arguments_dict(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise RequestFieldError(
            "messages", f"tool call arguments must be a JSON object, got {arguments!r}"
        )
    return parsed


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"] = "function"
    function: FunctionName


AUTO_TOOL_CHOICE_ERROR = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def _refuse_auto(value: Any) -> Any:
    if value == "auto":
        raise RequestFieldError("tool_choice", AUTO_TOOL_CHOICE_ERROR)
    return value


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None  # None: as many as the context leaves
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    # vLLM's extra: the template's options (not the arguments the server gives it)
    chat_template_kwargs: (
        Annotated[
            dict[str, Any],
            Field(
                json_schema_extra={
                    "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_ARGUMENTS)}}
                }
            ),
        ]
        | None
    ) = None
    tools: list[ChatCompletionTool] | None = None
    # "none" (the default without tools): answer in text; "required": call one or more of the
    # tools; a named function: call that one. ("auto" needs a tool parser, which minivllm has
    # not: as in vLLM without one, it is refused, and it is the default when tools are given.)
    tool_choice: Annotated[
        Literal["none", "required"] | NamedToolChoice | None, BeforeValidator(_refuse_auto)
    ] = None
    # false: at most one call; true (OpenAI's default): any number, each a different call
    parallel_tool_calls: bool | None = None
    functions: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    modalities: list[Literal["text"]] | None = None  # minivllm answers in text only

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is a forced tool call ("required" or a named function)."""
        return self.effective_tool_choice != "none"

    def left_out(self, name: str) -> bool:
        if name == "max_tokens":
            return super().left_out("max_tokens") and super().left_out("max_completion_tokens")
        return super().left_out(name)

    def check_supported(self) -> None:
        super().check_supported()
        choice = self.effective_tool_choice
        if choice == "auto":
            raise RequestFieldError("tool_choice", AUTO_TOOL_CHOICE_ERROR)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise RequestFieldError("tool_choice", "When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise RequestFieldError(
                "tool_choice", f"Tool '{choice.function.name}' has not been passed in `tools`."
            )

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (also with tool_choice "none", as vLLM)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_call_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced tool call must fit, as vLLM builds it: a named function's
        parameters, or for "required" an array of {"name", "parameters"} objects."""
        choice = self.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            tool = self.tools[self.tool_names.index(choice.function.name)]
            return _parameters_schema(tool)
        if choice != "required":
            return None
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [tool.function.name]},
                            "parameters": _parameters_schema(tool),
                        },
                        "required": ["name", "parameters"],
                    }
                    for tool in self.tools
                ],
            },
        }
        # A parameters schema's "#/$defs/..." references resolve against the root here.
        definitions = {}
        for tool in self.tools:
            definitions.update(_parameters_schema(tool).get("$defs", {}))
        if definitions:
            schema["$defs"] = definitions
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def output_form(self) -> StructuredOutputsParams | None:
        schema = self.tool_call_schema()
        if schema is None:
            return super().output_form()
        if super().output_form() is not None:
            raise RequestFieldError(
                "tool_choice",
                "tool_choice required or a named function cannot be combined with "
                "response_format or structured_outputs: the tool's schema is the answer's form",
            )
        return StructuredOutputsParams(json=schema)

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestFieldError("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.to_sampling_params(max_tokens, logprobs, defaults, self.prompt_logprobs)


def _parameters_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's two forms: a text, or a conversation through the chat template (which wins if
    both are given)."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise RequestFieldError("prompt", "give a prompt or messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


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


class PromptLogprob(OpenAIBaseModel):
    """vLLM's form of one candidate in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token, the first None (nothing comes before it): {token id: candidate}.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra


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
    tool_calls: list[ToolCall] = Field(default_factory=list)


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
