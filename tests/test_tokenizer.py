"""Properties of the shared text <-> tokens layer (minivllm/tokenizer.py).

The expectations are worked out with the tokenizer itself on the *whole* sequence: decoding all
the ids at once, or every prefix of them, which is slow but obviously right. The code under
test decodes a small window per token; these checks say the fast way gives the same text.
"""

from __future__ import annotations

import os

# Never touch the network: huggingface_hub reads this once, when transformers first imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minivllm.models.loader import embedded_model_dir, load_tokenizer  # noqa: E402
from minivllm.tokenizer import (  # noqa: E402
    IncrementalDetokenizer,
    apply_chat_template,
    encode_prompt,
)

REPLACEMENT_CHAR = "\ufffd"
CHAT = [{"role": "user", "content": "Say hello."}]

# Characters whose UTF-8 spelling takes 2, 3 or 4 bytes, so byte-level BPE often splits them
# across tokens, mixed with ordinary ASCII and whatever else Hypothesis likes to try.
MULTI_BYTE = list("éüñçßø中文字日本語한국😀🎉👍🏽🚀∑€…")
any_text = st.text(
    st.one_of(st.characters(codec="utf-8"), st.sampled_from(MULTI_BYTE + list("ab .\n"))),
    max_size=40,
)
# SmolLM2's vocabulary has no token for a few bytes: six control characters and 0xF1/0xF2, the
# lead bytes of code points U+40000..U+BFFFF (unassigned planes). Encoding silently drops those
# bytes, so text using them cannot come back unchanged; this text avoids them.
spellable_text = st.text(
    st.one_of(
        st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_categories=("Cc",)),
        st.sampled_from(MULTI_BYTE + list("ab .\n")),
    ),
    max_size=40,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="module")
def chat_prompt_ids(tokenizer) -> list[int]:
    return apply_chat_template(tokenizer, CHAT)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed the tokens one by one, as an engine does; return every piece a client would see,
    the last one from take_new_text(finished=True). Stops feeding at a stop string."""
    deltas = []
    for token_id in token_ids:
        stopped = detokenizer.append_token(token_id) is not None
        deltas.append(detokenizer.take_new_text())
        if stopped:
            break
    deltas.append(detokenizer.take_new_text(finished=True))
    return deltas


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


# --- incremental detokenization --------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(text=any_text, use_chat_prompt=st.booleans(), skip_special_tokens=st.booleans())
def test_streamed_text_is_the_full_decode(
    tokenizer, chat_prompt_ids, text, use_chat_prompt, skip_special_tokens
):
    """Streaming token by token gives the same text as decoding all the ids at once, and no
    piece ever shows a half character as "\\ufffd".

    (The ids of text with a character the vocabulary cannot spell, see `spellable_text`, hold
    a genuinely broken character, which the full decode shows as "\\ufffd" too.)"""
    output_ids = tokenizer.encode(text)
    prompt_ids = chat_prompt_ids if use_chat_prompt else []
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
    )

    deltas = stream(detokenizer, output_ids)

    expected = decode(tokenizer, output_ids, skip_special_tokens)
    if REPLACEMENT_CHAR not in expected:
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "".join(deltas) == expected
    assert detokenizer.output_text == expected


def test_an_emoji_split_over_tokens_is_never_shown_half(tokenizer):
    """The emoji "😀" is three byte-level tokens; nothing is shown until the third completes
    it."""
    first, second, third = tokenizer.encode("😀")
    assert REPLACEMENT_CHAR in decode(tokenizer, [first])  # the premise: the split is real
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Look:"))

    shown = []
    for token_id in (first, second, third):
        detokenizer.append_token(token_id)
        shown.append(detokenizer.take_new_text())

    assert shown == ["", "", "😀"]


def test_a_sequence_ending_in_half_a_character_reads_like_decode(tokenizer):
    """If generation stops in the middle of a character, the held-back bytes are released
    at the end as "\\ufffd", exactly as tokenizer.decode renders them."""
    output_ids = tokenizer.encode("ok 😀")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer, [])

    deltas = stream(detokenizer, output_ids)

    assert REPLACEMENT_CHAR not in "".join(deltas[:-1])
    assert "".join(deltas) == decode(tokenizer, output_ids)
    assert detokenizer.output_text == decode(tokenizer, output_ids)


def test_the_first_output_token_keeps_its_leading_space(tokenizer):
    """After the prompt "Hello", the token " world" streams as " world", space included."""
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))

    deltas = stream(detokenizer, tokenizer.encode(" world"))

    assert "".join(deltas) == " world"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_are_skipped_only_when_asked(tokenizer, skip_special_tokens):
    """An end-of-turn token in the output is dropped from the text with
    skip_special_tokens=True and spelled out with False, as in tokenizer.decode."""
    output_ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)

    text = "".join(stream(detokenizer, output_ids))

    assert text == decode(tokenizer, output_ids, skip_special_tokens)
    assert (tokenizer.eos_token in text) is not skip_special_tokens


# --- stop strings ----------------------------------------------------------------------------


def test_text_is_cut_right_before_the_stop_string(tokenizer):
    """With stop=["."], "The answer is 42. Done" ends as "The answer is 42", and the token
    that produced the "." is the one that reports the stop."""
    output_ids = tokenizer.encode("The answer is 42. Done")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["."])

    reported = [detokenizer.append_token(token_id) for token_id in output_ids[:7]]

    assert decode(tokenizer, output_ids[:7]).endswith(".")  # token 7 is the "."
    assert reported == [None] * 6 + ["."]
    assert detokenizer.output_text == "The answer is 42"


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    """With include_stop_str_in_output=True the text is cut right after the stop string."""
    detokenizer = IncrementalDetokenizer(
        tokenizer, [], stop=["is"], include_stop_str_in_output=True
    )

    deltas = stream(detokenizer, tokenizer.encode("The answer is 42. Done"))

    assert detokenizer.output_text == "The answer is"
    assert "".join(deltas) == "The answer is"


def test_a_stop_string_spanning_two_tokens_is_found(tokenizer):
    """The stop string "o w" is the end of "Hello" and the start of " world": no single token
    holds it, yet the second token reports it."""
    output_ids = tokenizer.encode("Hello world")
    assert not any("o w" in decode(tokenizer, [token_id]) for token_id in output_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["o w"])

    reported = [detokenizer.append_token(token_id) for token_id in output_ids]

    assert reported == [None, "o w"]
    assert detokenizer.output_text == "Hell"


def test_a_possible_stop_prefix_is_held_back_until_it_is_decided(tokenizer):
    """With stop=["STOP"], after "Go ST" the client sees only "Go": " ST" might become the
    stop string. If "AY" follows, " STAY" is released; if "OP" follows, it never is."""
    go, st_token, ay = tokenizer.encode("Go STAY")
    op = tokenizer.encode("Go STOP")[-1]

    waiting = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    waiting.append_token(go)
    waiting.append_token(st_token)
    assert waiting.take_new_text() == "Go "
    waiting.append_token(ay)
    assert waiting.take_new_text() == "STAY"

    stopped = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    assert stream(stopped, [go, st_token, op]) == ["Go", " ", "", ""]
    assert stopped.output_text == "Go "


def expected_stop(tokenizer, output_ids, stop, include):
    """The reference answer, from decoding every prefix of the output in full: the first
    prefix whose text (not ending in half a character) contains a stop string is cut at the
    earliest such string. Returns (text, matched stop string or None)."""
    for length in range(1, len(output_ids) + 1):
        text = decode(tokenizer, output_ids[:length])
        if text.endswith(REPLACEMENT_CHAR):
            continue
        found = [(text.index(s), s) for s in stop if s in text]
        if found:
            start, matched = min(found, key=lambda pair: pair[0])
            return text[: start + len(matched) if include else start], matched
    return decode(tokenizer, output_ids), None


STOP_ALPHABET = "ab .é中😀"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(STOP_ALPHABET, max_size=30),
    stop=st.lists(st.text(STOP_ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streaming_never_shows_text_that_a_stop_string_later_cuts(tokenizer, text, stop, include):
    """Every piece the client has seen so far is the start of the final text (nothing shown
    is ever taken back), the pieces join to the final text, and the final text and stop
    string are what decoding every prefix in full finds."""
    output_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(
        tokenizer, [], stop=stop, include_stop_str_in_output=include
    )

    seen, matched = "", None
    for token_id in output_ids:
        matched = detokenizer.append_token(token_id)
        seen += detokenizer.take_new_text()
        assert detokenizer.output_text.startswith(seen)
        if matched is not None:
            break
    seen += detokenizer.take_new_text(finished=True)

    assert (detokenizer.output_text, matched) == expected_stop(tokenizer, output_ids, stop, include)
    assert seen == detokenizer.output_text


def test_stop_strings_are_ignored_within_min_tokens(tokenizer):
    """Like vLLM, a stop string only counts once min_tokens tokens exist: "." in the first
    two tokens is ignored, the later one stops the text."""
    output_ids = tokenizer.encode(". a. b")
    assert [decode(tokenizer, [t]) for t in output_ids] == [".", " a", ".", " b"]
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["."], min_tokens=2)

    reported = [detokenizer.append_token(token_id) for token_id in output_ids[:3]]

    assert reported == [None, None, "."]
    assert detokenizer.output_text == ". a"


def test_no_tokens_are_accepted_after_a_stop_string(tokenizer):
    """Once a stop string has ended the sequence, appending more is an engine bug."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["Hello"])
    assert detokenizer.append_token(tokenizer.encode("Hello")[0]) == "Hello"
    with pytest.raises(RuntimeError, match="already ended"):
        detokenizer.append_token(tokenizer.encode(" world")[0])


def test_empty_stop_string_is_rejected(tokenizer):
    """An empty stop string would match everywhere; it is an error, not a silent stop."""
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], stop=[""])


# --- prompts ---------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(text=spellable_text)
def test_encode_prompt_adds_nothing_and_round_trips(tokenizer, text):
    """SmolLM2 adds no BOS to a plain prompt, and its byte-level BPE loses nothing it can
    spell: decoding the ids gives the prompt back."""
    ids = encode_prompt(tokenizer, text)

    assert tokenizer.bos_token_id not in ids or tokenizer.bos_token in text
    assert decode(tokenizer, ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, add_generation_prompt):
    """The ids are those of the template's rendered text, and with add_generation_prompt
    the text ends by opening the assistant's turn."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi! 😀"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )

    ids = apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt)

    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert all(type(token_id) is int for token_id in ids)
    assert rendered.endswith("<|im_start|>assistant\n") is add_generation_prompt


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        ["hello"],
        [{"role": "user"}],
        [{"content": "hello"}],
        [{"role": "user", "content": 3}],
        [{"role": None, "content": "hello"}],
        [{"role": "user", "content": "fine"}, {"role": "assistant"}],
    ],
)
def test_malformed_messages_are_rejected(tokenizer, messages):
    """A conversation must be a non-empty list of dicts with string "role" and "content"."""
    with pytest.raises(ValueError, match="message"):
        apply_chat_template(tokenizer, messages)


def test_a_tokenizer_without_chat_template_is_rejected():
    """A base model's tokenizer cannot format a conversation; say so instead of guessing."""
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(SimpleNamespace(chat_template=None), CHAT)
