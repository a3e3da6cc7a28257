"""Chapter 09 — outputs as deltas: what a step added to a request, not the whole request again.

`LLMEngine.step()` returns each advancing request's cumulative `RequestOutput`: all its tokens
and logprobs so far. Sending that every step costs O(n) per step, and a stream nobody reads
would keep n copies, O(n^2) memory. So, as in vLLM's `RequestOutputKind.DELTA`, only the new
part travels from the engine core to the front end, which joins the parts back into the
cumulative `RequestOutput` a consumer reads:

    engine core                          front end
    cumulative output --OutputDeltas-->  delta --OutputProcessor-->  delta with text
    tokens [5, 9, 2]                     [2]     " wor"              --merge_delta-->
                                                                     "Hello wor", [5, 9, 2]

A delta is a `RequestOutput` whose `CompletionOutput`s hold only the new token ids and
logprobs; every other field (finish reason, stop reason, error, cumulative logprob, metrics)
is the current value. The prompt is not repeated (the front end has it: it processed the
request), and the prompt logprobs come once.

No text crosses: the core runs the server's requests without detokenizing, and the front
end's output processor (engine/output_processor.py) turns the new token ids into the new
text, decoded tokens and stop strings before `merge_delta` joins them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from minivllm.outputs import CompletionOutput, RequestOutput

# The parts of a CompletionOutput that grow, so that a delta carries only their new end.
GROWING_FIELDS = ("text", "token_ids", "logprobs")


@dataclass
class RequestProgress:
    """How much of one request the front end has been sent."""

    tokens_sent: list[int] = field(default_factory=list)  # per completion
    prompt_logprobs_sent: bool = False


class OutputDeltas:
    """The engine core's side: remembers what each request has been sent and turns its
    cumulative outputs into deltas."""

    def __init__(self) -> None:
        self.progress: dict[str, RequestProgress] = {}

    def add(self, request_id: str) -> None:
        self.progress[request_id] = RequestProgress()

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.progress.pop(request_id, None)

    def split(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The deltas of one step's outputs (a request this does not know, aborted in the
        meantime, is left out). A finished request is forgotten."""
        deltas = []
        for output in outputs:
            progress = self.progress.get(output.request_id)
            if progress is None:
                continue
            deltas.append(self._delta(output, progress))
            if output.finished:
                del self.progress[output.request_id]
        return deltas

    def _delta(self, output: RequestOutput, progress: RequestProgress) -> RequestOutput:
        while len(progress.tokens_sent) < len(output.outputs):
            progress.tokens_sent.append(0)
        completions = []
        for i, completion in enumerate(output.outputs):
            sent, logprobs = progress.tokens_sent[i], completion.logprobs
            completions.append(
                replace(
                    completion,
                    text="",
                    token_ids=completion.token_ids[sent:],
                    logprobs=None if logprobs is None else logprobs[sent:],
                )
            )
            progress.tokens_sent[i] = len(completion.token_ids)
        prompt_logprobs = None
        if output.prompt_logprobs is not None and not progress.prompt_logprobs_sent:
            prompt_logprobs, progress.prompt_logprobs_sent = output.prompt_logprobs, True
        return replace(
            output,
            prompt=None,
            prompt_token_ids=[],
            outputs=completions,
            prompt_logprobs=prompt_logprobs,
        )


def new_request_output(request_id: str, prompt: dict) -> RequestOutput:
    """The front end's cumulative output of a request before its first delta."""
    return RequestOutput(
        request_id=request_id,
        prompt=prompt.get("prompt"),
        prompt_token_ids=list(prompt["prompt_token_ids"]),
        outputs=[],
        finished=False,
    )


def merge_delta(output: RequestOutput, delta: RequestOutput) -> None:
    """The front end's side: add a delta to the cumulative `output`, in place."""
    for i, new in enumerate(delta.outputs):
        if i == len(output.outputs):
            output.outputs.append(copy_completion(new))
            continue
        completion = output.outputs[i]
        completion.text += new.text
        completion.token_ids.extend(new.token_ids)
        if new.logprobs is not None:
            if completion.logprobs is None:
                completion.logprobs = []
            completion.logprobs.extend(new.logprobs)
        for f in fields(CompletionOutput):
            if f.name not in GROWING_FIELDS:
                setattr(completion, f.name, getattr(new, f.name))
    output.finished = delta.finished
    output.metrics = delta.metrics
    output.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        output.prompt_logprobs = delta.prompt_logprobs


def snapshot(output: RequestOutput) -> RequestOutput:
    """A copy of a cumulative output that later deltas do not change (what a consumer gets)."""
    return replace(output, outputs=[copy_completion(c) for c in output.outputs])


def copy_completion(completion: CompletionOutput) -> CompletionOutput:
    logprobs = completion.logprobs
    return replace(
        completion,
        token_ids=list(completion.token_ids),
        logprobs=None if logprobs is None else list(logprobs),
    )
