"""Chapter 09 — the front end's output processor: token ids in, text out, stop strings checked.

The server's engine core does not detokenize (engine/core.py). It runs every request with
`detokenize=False` and without its stop strings, checks only the rules that need no text
(EOS, stop token ids, a complete grammar, max_tokens, the context) and sends token ids and
logprobs. Text is made here, in the front end, as in vLLM V1 (whose class has this name), so
detokenizing costs the engine's process nothing:

    engine core                             front end: one IncrementalDetokenizer per sequence
    delta: new token ids, logprobs,  ---->  new text, held back while it may still change
    token-level finish reason               decoded tokens of the logprobs
                                            a stop string? the sequence ends here, and the
                                            core is told to abort it

A stop string found here ends its sequence exactly as it would have ended in the engine
(`Request._check_stop`): finish reason "stop", the string as stop reason, the text cut before
it, and no token after the one that completed it (a step of speculative decoding may bring
several). The core knew nothing of it and would go on, so it is told to abort the sequence,
and its blocks are freed; a request with n > 1 ends once all its sequences have.

The offline `LLM` keeps detokenizing in its engine (chapter 04): there, engine and user share
one process anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sample.sampling_params import SamplingParams
from minivllm.tokenizer import IncrementalDetokenizer

# One token's candidates, as in CompletionOutput.logprobs and RequestOutput.prompt_logprobs.
Candidates = dict[int, Logprob]


def core_params(params: SamplingParams) -> SamplingParams:
    """What the engine core is given of a request's sampling parameters: everything but the
    text's rules, which the front end applies (no detokenizing, no stop strings)."""
    return replace(params, detokenize=False, stop=[])


@dataclass
class SequenceState:
    """One completion as the front end knows it."""

    detokenizer: IncrementalDetokenizer | None  # None when the user asked for no text
    cumulative_logprob: float | None  # as of the last token kept
    # Once a stop string ended it here: its final state, with nothing new (what a delta of
    # it says from then on).
    stopped: CompletionOutput | None = None


@dataclass
class RequestState:
    params: SamplingParams  # the user's own
    sequences: list[SequenceState]


@dataclass
class ProcessedOutputs:
    """One step's outputs as the front end's consumers see them (deltas with text), and what
    the core must stop because a stop string ended it here."""

    outputs: list[RequestOutput] = field(default_factory=list)
    requests_to_abort: list[str] = field(default_factory=list)
    sequences_to_abort: list[tuple[str, int]] = field(default_factory=list)


class OutputProcessor:
    """Turns the core's token-only deltas into deltas with text. Used on one thread."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        cumulative_logprob = None if params.logprobs is None else 0.0
        sequences = [
            SequenceState(self._detokenizer(prompt_token_ids, params), cumulative_logprob)
            for _ in range(params.n)
        ]
        self.requests[request_id] = RequestState(params, sequences)

    def _detokenizer(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer.for_params(self.tokenizer, prompt_token_ids, params)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget requests (aborted, failed); unknown ids are ignored."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def process_outputs(self, deltas: list[RequestOutput]) -> ProcessedOutputs:
        """The deltas of one core step, with text. A request this does not know (aborted in
        the meantime) is left out; a finished one is forgotten."""
        processed = ProcessedOutputs()
        for delta in deltas:
            request = self.requests.get(delta.request_id)
            if request is None:
                continue
            output, stopped_here = self._process(request, delta)
            processed.outputs.append(output)
            if not output.finished:
                processed.sequences_to_abort += [(delta.request_id, i) for i in stopped_here]
                continue
            del self.requests[delta.request_id]
            if not delta.finished:  # it ended here, and the core still runs it
                processed.requests_to_abort.append(delta.request_id)
        return processed

    def _process(
        self, request: RequestState, delta: RequestOutput
    ) -> tuple[RequestOutput, list[int]]:
        """A request's delta with text, and the sequences a stop string ended in it."""
        completions, stopped_here = [], []
        for sequence, new in zip(request.sequences, delta.outputs, strict=True):
            if sequence.stopped is not None:  # what the core still sends of it is not wanted
                completions.append(sequence.stopped)
                continue
            completions.append(self._advance(sequence, new))
            if sequence.stopped is not None:
                stopped_here.append(new.index)
        prompt_logprobs = delta.prompt_logprobs
        if prompt_logprobs is not None and request.params.detokenize:
            prompt_logprobs = [self._decoded(entries) for entries in prompt_logprobs]
        output = replace(
            delta,
            outputs=completions,
            finished=all(c.finish_reason is not None for c in completions),
            prompt_logprobs=prompt_logprobs,
        )
        return output, stopped_here

    def _advance(self, sequence: SequenceState, new: CompletionOutput) -> CompletionOutput:
        """One live sequence's delta with text; the sequence ends here if a stop string
        completes in it."""
        detokenizer = sequence.detokenizer
        token_ids, stop_string = new.token_ids, None
        if detokenizer is not None:
            token_ids, stop_string = self._detokenize(detokenizer, new)
        logprobs = new.logprobs
        if logprobs is not None:
            logprobs = logprobs[: len(token_ids)]
            if detokenizer is not None:
                logprobs = [self._decoded(entries) for entries in logprobs]
        if stop_string is None:
            finish_reason, stop_reason, error = new.finish_reason, new.stop_reason, new.error
            cumulative_logprob = new.cumulative_logprob
        else:
            finish_reason, stop_reason, error = "stop", stop_string, None
            cumulative_logprob = cumulative_logprob_after(sequence, token_ids, logprobs, new)
        sequence.cumulative_logprob = cumulative_logprob
        text = ""
        if detokenizer is not None:
            text = detokenizer.take_new_text(finished=finish_reason is not None)
        completion = CompletionOutput(
            index=new.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            error=error,
        )
        if stop_string is not None:  # from now on, the same final state with nothing new
            sequence.stopped = replace(
                completion, text="", token_ids=[], logprobs=None if logprobs is None else []
            )
        return completion

    @staticmethod
    def _detokenize(
        detokenizer: IncrementalDetokenizer, new: CompletionOutput
    ) -> tuple[list[int], str | None]:
        """Feed the new tokens to the detokenizer, up to a stop string: the tokens kept and
        the stop string, if one completed. A token with which the core ended the sequence as
        "stop" (EOS, a stop token id, a grammar's end) is never text (`Request._check_stop`)."""
        token_ids = new.token_ids
        text_ids = token_ids[:-1] if new.finish_reason == "stop" else token_ids
        for position, token_id in enumerate(text_ids):
            stop_string = detokenizer.append_token(token_id)
            if stop_string is not None:
                return token_ids[: position + 1], stop_string
        return token_ids, None

    def _decoded(self, entries: Candidates | None) -> Candidates | None:
        """Candidates with their text, as the engine decodes them (`Request._logprob_entries`)."""
        if entries is None:  # the prompt's first token: nothing predicts it
            return None
        return {
            token_id: replace(entry, decoded_token=self.tokenizer.decode([token_id]))
            for token_id, entry in entries.items()
        }


def cumulative_logprob_after(
    sequence: SequenceState,
    token_ids: list[int],
    logprobs: list[Candidates] | None,
    new: CompletionOutput,
) -> float | None:
    """The cumulative logprob as of the last token kept. The core's value counts every token
    it sent; when a stop string cut some away, the kept ones are added to the previous value
    one by one, in the order (and so to the very float) the engine would have added them."""
    if logprobs is None or len(token_ids) == len(new.token_ids):
        return new.cumulative_logprob
    total = sequence.cumulative_logprob
    for token_id, entries in zip(token_ids, logprobs, strict=True):
        total += entries[token_id].logprob
    return total
