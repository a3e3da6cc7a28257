"""Text <-> tokens: chat templates, prompt encoding, and streaming detokenization.

This module belongs to the shared layer used by every chapter. Whatever the engine looks like,
a request enters as text and leaves as text, and this is where the two conversions live:

* `apply_chat_template` and `encode_prompt` turn a conversation or a plain prompt into token
  ids, using the model's own tokenizer and chat template.
* `IncrementalDetokenizer` turns the generated ids back into text one token at a time, for
  streaming. Two ideas make that correct:

  - A token is a run of *bytes*, not characters (a byte-level BPE may spell one emoji as three
    tokens), so text is decoded over a small sliding window of tokens and held back while it
    ends in half a character. This is vLLM's prefix_offset/read_offset technique.
  - Stop strings are searched only in the region a new token could have completed, the text is
    cut at the first match, and while streaming the client is never shown the beginning of a
    stop string that might later be cut away.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.sample.sampling_params import SamplingParams

# What a UTF-8 decoder produces for bytes that do not (yet) form a whole character.
REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens are decoded as context in front of the first output token (as in
# vLLM). Some tokenizers decide from the previous token whether a token starts a new word:
# SentencePiece's "▁Hello" decodes to "Hello" at the start of a text but " Hello" after
# another word. A few tokens of context give the first output token its true leading space.
PROMPT_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string was found in the output text."""

    stop: str
    start: int  # index in the text of the stop string's first character


# Arguments of `tokenizer.apply_chat_template` that a template option must not replace.
RESERVED_TEMPLATE_ARGUMENTS = ("conversation", "add_generation_prompt", "tokenize", "tools")


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The token ids of a conversation, formatted by the tokenizer's own chat template.

    `messages` is a list of {"role": str, "content": str} dicts (an assistant turn may also
    carry "tool_calls", a tool's answer "tool_call_id"). With `add_generation_prompt` the ids
    end with the header of an assistant turn (for SmolLM2, "<|im_start|>assistant\\n"), so the
    model's next tokens are the assistant's answer. `tools` (OpenAI's function definitions)
    are given to the template, which decides how the model sees them, and `template_kwargs`
    are the template's own options (vLLM's `chat_template_kwargs`, e.g. enable_thinking).
    """
    _validate_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this tokenizer has no chat template, so it cannot format a conversation; "
            "give a plain text prompt instead, or use a chat (instruct) model"
        )
    template_kwargs = dict(template_kwargs or {})
    reserved = [name for name in template_kwargs if name in RESERVED_TEMPLATE_ARGUMENTS]
    if reserved:
        raise ValueError(f"chat_template_kwargs must not set {', '.join(reserved)}")
    encoded = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        tools=tools,
        **template_kwargs,
    )
    # transformers 5 returns a BatchEncoding (a mapping with "input_ids"); 4.x returned the
    # list itself.
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    return [int(token_id) for token_id in ids]


def _validate_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of {{'role': str, 'content': str}} dicts, "
            f"got {messages!r}"
        )
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {position} must be a dict, got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"message {position} needs a string {key!r}, got {message.get(key)!r}"
                )


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The token ids of a plain text prompt.

    The tokenizer adds whatever special tokens it adds by default: a Llama-2 tokenizer
    prepends BOS, SmolLM2's adds nothing, so its ids are exactly the text's tokens.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    return list(tokenizer.encode(prompt))


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, one token at a time.

    After each `append_token`, `output_text` is the text so far (cut at a stop string once one
    matched) and `take_new_text()` returns the part of it a streaming client may be shown now.
    Joining everything `take_new_text` returns, the last call with `finished=True`, gives
    exactly `output_text`.

    Without a stop string, `output_text` equals
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.
    Space clean-up (turning " ." into ".") is a whole-text rewrite that a windowed decode cannot
    reproduce exactly, so, like vLLM, we never apply it; SmolLM2's tokenizer does not either.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        stop = list(stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        # Like vLLM, a stop string only counts once min_tokens tokens have been generated.
        self.min_tokens = min_tokens

        # The decode window is token_ids[prefix_offset:]. token_ids[prefix_offset:read_offset]
        # has already been turned into text; the tokens after read_offset have not.
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._num_output_tokens = 0

        self._text = ""  # whole characters decoded so far (cut at a stop string)
        self._pending_text = ""  # decoded text waiting for its last character to complete
        self._stop_checked_len = 0  # the text before this index holds no stop string
        self._matched_stop: str | None = None
        self._num_chars_taken = 0  # how much of the text take_new_text has returned

    @classmethod
    def for_params(
        cls, tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """The detokenizer of one sequence of a request with these sampling parameters."""
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def output_text(self) -> str:
        """The full text so far, cut at the stop string if one matched.

        It includes a trailing incomplete character (as "\\ufffd"), so that a sequence that
        ends there reads exactly like `tokenizer.decode` of its ids.
        """
        return self._text + self._pending_text

    def append_token(self, token_id: int) -> str | None:
        """Add one generated token; return the stop string it completed, if any."""
        if self._matched_stop is not None:
            raise RuntimeError(
                f"the stop string {self._matched_stop!r} already ended this sequence; "
                "no more tokens can be appended"
            )
        self._token_ids.append(token_id)
        self._num_output_tokens += 1
        self._text += self._decode_new_text()
        if self._num_output_tokens < self.min_tokens:
            self._stop_checked_len = len(self._text)
            return None
        return self._check_stop_strings()

    def take_new_text(self, finished: bool = False) -> str:
        """The text not returned before, minus what may still change or be cut.

        Held back are a trailing incomplete character and, while streaming with stop strings,
        a tail that could be the beginning of a stop string. `finished=True` (the sequence is
        over) releases everything.
        """
        if finished or self._matched_stop is not None:
            end = len(self.output_text)
        else:
            end = len(self._text) - self._possible_stop_prefix_len()
        new_text = self.output_text[self._num_chars_taken : end]
        self._num_chars_taken = end
        return new_text

    def _decode_new_text(self) -> str:
        """The text the newest token adds, or "" while the window ends inside a character.

        We decode only the window token_ids[prefix_offset:], a handful of tokens, rather than
        the whole output, so each token costs O(1) instead of O(length). The window starts a
        little before read_offset because decoding a token alone can lose context (the
        leading space above); the already-returned part of the window's text is cut off by
        its length.
        """
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._token_ids))
        # A trailing "\ufffd" means the last token ended part way through a multi-byte
        # character; the next token(s) will complete it, so wait rather than show "\ufffd".
        # A window no longer than before (a skipped special token) has nothing new either.
        if window_text.endswith(REPLACEMENT_CHAR) or len(window_text) <= len(prefix_text):
            self._pending_text = window_text[len(prefix_text) :]
            return ""
        self._pending_text = ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return window_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self._token_ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _check_stop_strings(self) -> str | None:
        """Cut the text at a stop string completed since the last check, if there is one."""
        match = find_stop_string(self._text, self.stop, self._stop_checked_len)
        self._stop_checked_len = len(self._text)
        if match is None:
            return None
        end = match.start + len(match.stop) if self.include_stop_str_in_output else match.start
        self._text = self._text[:end]
        self._pending_text = ""
        self._matched_stop = match.stop
        return match.stop

    def _possible_stop_prefix_len(self) -> int:
        """How many trailing characters to hold back because a stop string may start there.

        Only the text before a stop string survives the cut, so a client shown "ST" when the
        stop string is "STOP" would see text that is later taken back. When the stop string is
        kept in the output, the cut comes after it and nothing already shown is ever removed.
        """
        if self.include_stop_str_in_output:
            return 0
        return possible_stop_prefix_len(self._text, self.stop)


def possible_stop_prefix_len(text: str, stop: list[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of some stop string:
    at most (longest stop string - 1) characters, and usually none."""
    longest = 0
    for candidate in stop:
        for length in range(min(len(candidate) - 1, len(text)), longest, -1):
            if text.endswith(candidate[:length]):
                longest = length
                break
    return longest


def find_stop_string(text: str, stop: list[str], checked_len: int) -> StopMatch | None:
    """The earliest stop string in `text` that ends after `text[:checked_len]`.

    The first `checked_len` characters were searched before and held no stop string, so a new
    match must end after them: it starts at most len(stop) - 1 characters earlier. Searching
    only from there keeps each check proportional to the new text, not to the whole output.
    """
    best: StopMatch | None = None
    for candidate in stop:
        start = text.find(candidate, max(0, checked_len - len(candidate) + 1))
        if start != -1 and (best is None or start < best.start):
            best = StopMatch(candidate, start)
    return best
