"""Chapter 01b — sampling: turning a batch of logits into one next token per sequence.

Taught in `chapters/01b-decoding.md`, step by step on a real distribution in
`notebooks/01b-decoding.ipynb`. This is the shared sampling module used by every chapter.
Whatever the engine looks like around it (a plain loop, continuous batching, paged attention,
speculative decoding), the last step of a decode step is the same: the model hands back one row
of logits per running sequence, and the `Sampler` picks one token for each row, each according
to that request's own `SamplingParams`.

The idea it holds is that sampling is a pipeline of small, separate transforms on the logits,
applied to the whole batch at once with per-row parameters:

    (raw logprobs are read here) -> logit_bias -> penalties -> min_tokens ban
    -> greedy: argmax                                  (processed logprobs of a greedy row)
    -> random: temperature -> top-k -> top-p -> min-p  (processed logprobs of a random row)
       -> draw

and that the final draw uses an explicit random generator per seeded request, so a seeded request
produces the same tokens whichever other requests happen to share its batch.

One difference from vLLM V1's order: vLLM applies min-p right after the temperature, before
top-k and top-p. Alone, or with top-k, min-p keeps the same tokens either way (its window is
measured from the largest logit, which every filter keeps); with top-p as well, vLLM's top-p
works on the min-p-renormalised distribution and can keep fewer tokens.

NaN and inf never decide a token: a logit that came in at -inf (chapter 10's grammar mask) stays
there whatever the penalties do, NaN counts as -inf, and a row left with nothing to sample is
reported in `SamplerOutput.errors` (its request ends with that error) instead of giving token 0.

Which logprobs a request gets back is the engine's `logprobs_mode` (vLLM's names and default):
"raw_logprobs", the log_softmax of the model's own logits, or "processed_logprobs", of the
logits the token was actually chosen from; the "_logits" variants report the logits themselves.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.config import LOGPROBS_MODES
from minivllm.sample.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far for this sequence
    generator: torch.Generator | None  # the request's own generator when params.seed is set
    # Banned (with params.stop_token_ids) while fewer than params.min_tokens tokens exist. The
    # ban holds even with ignore_eos; an engine that wants eos left alone there passes ().
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class TokenLogprobs:
    """Log-probabilities around one sampled token (or one prompt token, for prompt logprobs).
    Under the "_logits" logprobs modes the numbers are logits instead."""

    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int  # 1 = most likely token
    top: list[tuple[int, float]]  # the params.logprobs most likely (token_id, logprob), best first


@dataclass
class SamplerOutput:
    """One sampler call's result, row for row with the logits."""

    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row, None when params.logprobs is None
    # Per row, why nothing could be sampled (its token is then meaningless), None for a good
    # row: the request ends with that error, the rest of the batch goes on.
    errors: list[str | None]


# A row whose every logit is NaN or -inf once the grammar, penalties and min_tokens are applied.
NOTHING_TO_SAMPLE = "no token can be sampled: every logit is NaN or -inf"


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh random generator for one seeded request; keep it for the request's lifetime."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


# --- logit transforms: each takes [rows, vocab] logits and per-row parameters of shape [rows] ---


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    """vLLM's three penalties. Repetition looks at prompt and output; the other two at output only.

    Repetition divides positive logits and multiplies negative ones, so either way a token that
    was seen becomes less likely. Frequency grows with each repeat; presence is a flat charge.

    A penalty makes a token unlikely, never impossible: a product past float32's range (a
    penalty of 1e308 is inf in float32) stops at the lowest finite float32 instead of -inf,
    where a grammar leaving only seen tokens would have nothing left to sample.
    """
    vocab_size = logits.shape[-1]
    prompt_counts = _token_counts(prompt_token_ids, vocab_size, logits.device)
    output_counts = _token_counts(output_token_ids, vocab_size, logits.device)
    repetition = repetition_penalty.to(logits.device, torch.float32).unsqueeze(1)
    frequency = frequency_penalty.to(logits.device, torch.float32).unsqueeze(1)
    presence = presence_penalty.to(logits.device, torch.float32).unsqueeze(1)

    seen = (prompt_counts > 0) | (output_counts > 0)
    discouraged = torch.where(logits > 0, logits / repetition, logits * repetition)
    overflowed = discouraged.isneginf() & ~logits.isneginf()  # a masked -inf stays -inf
    discouraged = discouraged.masked_fill(overflowed, torch.finfo(torch.float32).min)
    logits = torch.where(seen, discouraged, logits)
    return logits - frequency * output_counts - presence * (output_counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's {token id: bias} to its logits (OpenAI's logit_bias): +100 all but forces
    a token, -100 all but bans it."""
    rows, token_ids, values = [], [], []
    for row, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            rows.append(row)
            token_ids.append(token_id)
            values.append(value)
    index = (
        torch.tensor(rows, device=logits.device),
        torch.tensor(token_ids, device=logits.device),
    )
    return logits.index_put(index, torch.tensor(values, device=logits.device), accumulate=True)


def ban_tokens(logits: torch.Tensor, banned_token_ids: list[list[int]]) -> torch.Tensor:
    """Set the listed token ids of each row to -inf, so they can be neither argmax nor drawn;
    except in a row where they are all that is left. There the ban would leave nothing to
    sample: a grammar that is complete (chapter 10) allows only its end, EOS, and the min_tokens
    ban must not take it away. The row is then left as it was, and the grammar wins."""
    banned = torch.zeros_like(logits, dtype=torch.bool)
    for row, token_ids in enumerate(banned_token_ids):
        banned[row, token_ids] = True
    leaves_something = ((logits > float("-inf")) & ~banned).any(dim=-1, keepdim=True)
    return logits.masked_fill(banned & leaves_something, float("-inf"))


def sanitize_logits(logits: torch.Tensor, forbidden: torch.Tensor) -> torch.Tensor:
    """Keep NaN and inf from undoing a mask. A repetition penalty that is 0 in float32 (5e-324
    is) turns a forbidden token's -inf into NaN (-inf * 0) and a positive logit into +inf, and a
    model can overflow on its own. So: a token that came in at -inf (the grammar's mask) stays
    -inf; NaN is no logit at all (-inf); and in a row with +inf logits those tokens are sure,
    which softmax would turn into NaN: they keep all the mass (0), the others none (-inf)."""
    logits = logits.masked_fill(forbidden | logits.isnan(), float("-inf"))
    sure = logits.isposinf()
    has_sure = sure.any(dim=-1, keepdim=True)
    if not has_sure.any():
        return logits
    sure_or_nothing = torch.where(sure, 0.0, float("-inf"))
    return torch.where(has_sure, sure_or_nothing, logits)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature, in float32's range: -inf stays the mark of a token
    that cannot be drawn, and no finite logit becomes one.

    A temperature past float32's largest number (1e308 is a valid float) would be inf, and
    -inf / inf is NaN: it is held at the largest, where every finite logit goes to about 0 (the
    uniform distribution such a temperature means). A logit the division pushes past the range
    (float32's lowest over 0.5) is held at the range's end: as -inf it could leave a row with
    nothing to draw, as +inf it would turn the softmax into NaN.
    """
    finfo = torch.finfo(torch.float32)
    temperature = temperature.to(logits.device, torch.float32).clamp_max(finfo.max)
    scaled = logits / temperature.unsqueeze(1)
    # -inf is the only logit here that is not finite: the sampler's fast path has none, and
    # otherwise sanitize_logits took NaN and +inf away.
    return scaled.clamp(finfo.min, finfo.max).masked_fill(logits.isneginf(), float("-inf"))


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits; k <= 0 or k >= vocab leaves the row alone.

    Ties at the boundary are all kept (anything equal to the k-th largest value survives), as in
    vLLM, so a row can keep more than k tokens when several share the k-th value.
    """
    vocab_size = logits.shape[-1]
    k = k.to(logits.device, torch.long)
    active = (k > 0) & (k < vocab_size)
    if not active.any():
        return logits
    descending = logits.sort(dim=-1, descending=True).values
    kth_largest = descending.gather(1, (k.clamp(1, vocab_size) - 1).unsqueeze(1))
    drop = (logits < kth_largest) & active.unsqueeze(1)
    return logits.masked_fill(drop, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p.

    The most likely token is always kept. Equal logits are ranked by token id (the sort is
    stable), so exactly one prefix of that order survives. Rows with p >= 1 are left alone rather
    than trusting a float cumulative sum to reach exactly 1.0.
    """
    p = p.to(logits.device, torch.float32)
    active = p < 1.0
    if not active.any():
        return logits
    sorted_logits, sorted_token_ids = logits.sort(dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # A token is needed only if the tokens ranked above it have not yet reached p.
    mass_above = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
    drop_sorted = (mass_above >= p.unsqueeze(1)) & active.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, sorted_token_ids, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(logits.device, torch.float32).unsqueeze(1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Picks one token per row of a logits batch, each row following its own SamplingParams."""

    def __init__(
        self,
        default_generator: torch.Generator | None = None,
        logprobs_mode: str = "raw_logprobs",
    ):
        # Used for rows without their own generator; None means torch's global RNG.
        self.default_generator = default_generator
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        adjusted, all_finite = self._adjusted_logits(logits, rows)

        # Fast path: greedy rows need nothing but argmax, so an all-greedy batch skips
        # temperature, truncation and the random draw altogether.
        token_ids = adjusted.argmax(dim=-1)
        random_rows, truncated = self._truncated_random_rows(adjusted, rows)
        if random_rows:
            token_ids[random_rows] = self._draw(truncated, [rows[i] for i in random_rows])
        return SamplerOutput(
            token_ids=token_ids.tolist(),
            logprobs=self._collect_logprobs(
                logits, adjusted, dict(zip(random_rows, truncated)), token_ids, rows
            ),
            # Only a row whose every logit is -inf has nothing to sample; with every logit
            # finite no row can be one, and the pass that looks for them is skipped.
            errors=[None] * len(rows)
            if all_finite
            else [NOTHING_TO_SAMPLE if nothing else None for nothing in _empty_rows(adjusted)],
        )

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row's token is drawn from, [rows, vocab]: after logit_bias,
        penalties, the min_tokens ban, temperature and truncation; one-hot at the argmax for
        greedy rows. Chapter 08's rejection sampler verifies draft tokens against it."""
        adjusted, _ = self._adjusted_logits(logits, rows)
        probs = F.one_hot(adjusted.argmax(dim=-1), adjusted.shape[-1]).float()
        random_rows, truncated = self._truncated_random_rows(adjusted, rows)
        if random_rows:
            probs[random_rows] = truncated.softmax(dim=-1)
        # A row with nothing to sample has no mass at all (the rejection sampler refuses it).
        return probs.masked_fill(adjusted.isneginf().all(dim=-1, keepdim=True), 0.0)

    def logprobs(
        self, logits: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]
    ) -> list[TokenLogprobs | None]:
        """The logprobs `__call__` would report had it sampled `token_ids` (chapter 08: tokens
        the rejection sampler emitted)."""
        adjusted, _ = self._adjusted_logits(logits, rows)
        random_rows, truncated = self._truncated_random_rows(adjusted, rows)
        token_ids = torch.tensor(token_ids, device=logits.device)
        return self._collect_logprobs(
            logits, adjusted, dict(zip(random_rows, truncated)), token_ids, rows
        )

    def _collect_logprobs(
        self,
        logits: torch.Tensor,
        adjusted: torch.Tensor,
        truncated: dict[int, torch.Tensor],
        token_ids: torch.Tensor,
        rows: list[SamplingRow],
    ) -> list[TokenLogprobs | None]:
        """TokenLogprobs for the rows whose params ask for logprobs, None for the others, read
        from the model's logits (raw modes) or from those the token was chosen from
        (processed modes: `adjusted`, or for a random row its `truncated` logits)."""
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(rows)
        if not wanted:
            return result
        if self.logprobs_mode.startswith("raw"):
            scores = logits[wanted].float()
        else:
            scores = torch.stack([truncated.get(i, adjusted[i]) for i in wanted])
        if self.logprobs_mode.endswith("logprobs"):
            scores = scores.log_softmax(dim=-1)
        num_top = [rows[i].params.logprobs for i in wanted]
        for i, token_logprobs in zip(wanted, rank_tokens(scores, token_ids[wanted], num_top)):
            result[i] = token_logprobs
        return result

    def _adjusted_logits(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, bool]:
        """logit_bias, penalties and the min_tokens ban, in float32: what a greedy row takes
        the argmax of; and whether every logit was found finite (the common step, left as it
        came). vLLM bans first, before the bias and the penalties; the result is the same,
        since neither lifts a -inf."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows), vocab] = [{len(rows)}, vocab], "
                f"got {list(logits.shape)}"
            )
        logits = logits.float()
        biased = any(row.params.logit_bias for row in rows)
        penalised = any(_has_penalties(row.params) for row in rows)
        banned_token_ids = [_stop_ids_still_banned(row) for row in rows]
        # The common step (no bias, penalty or ban, every logit finite: no grammar masked
        # any) has nothing to adjust. One pass over the logits checks it: their sum is finite
        # only if every logit is (an inf or a NaN makes it inf or NaN). Finite logits whose sum
        # overflows take the sanitizing path below, which leaves them as they are.
        if not (biased or penalised or any(banned_token_ids)) and logits.sum().isfinite():
            return logits, True
        forbidden = logits.isneginf()  # the grammar's mask (chapter 10): nothing may lift it
        if biased:
            logits = apply_logit_bias(logits, [row.params.logit_bias for row in rows])
        if penalised:
            logits = self._penalise(logits, rows)
        logits = sanitize_logits(logits, forbidden)
        if any(banned_token_ids):
            logits = ban_tokens(logits, banned_token_ids)
        return logits, False

    def _penalise(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return apply_penalties(
            logits,
            [row.prompt_token_ids for row in rows],
            [row.output_token_ids for row in rows],
            _param_tensor(rows, "repetition_penalty", torch.float32, logits.device),
            _param_tensor(rows, "frequency_penalty", torch.float32, logits.device),
            _param_tensor(rows, "presence_penalty", torch.float32, logits.device),
        )

    def _truncated_random_rows(
        self, adjusted: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], torch.Tensor]:
        """The rows that sample at random, and their logits after temperature, top-k, top-p
        and min-p (dropped tokens at -inf): the distribution each one draws from."""
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return [], adjusted[:0]
        params = [rows[i] for i in random_rows]
        logits, device = adjusted[random_rows], adjusted.device
        logits = apply_temperature(
            logits, _param_tensor(params, "temperature", torch.float32, device)
        )
        logits = apply_top_k(logits, _param_tensor(params, "top_k", torch.long, device))
        logits = apply_top_p(logits, _param_tensor(params, "top_p", torch.float32, device))
        return random_rows, apply_min_p(
            logits, _param_tensor(params, "min_p", torch.float32, device)
        )

    def _draw(self, truncated: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One draw per row from its truncated logits."""
        probs = truncated.softmax(dim=-1)
        # Exponential race: with E_i ~ Exp(1), argmax(p_i / E_i) is token i with probability p_i.
        # Unlike torch.multinomial on the batch, it lets each row take its noise from its own
        # generator. The clamp keeps a (rare) zero draw from turning a dropped token's 0/0 into a
        # NaN, which argmax would pick.
        noise = self._exponential_noise(rows, probs.shape[-1], probs.device)
        return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _exponential_noise(
        self, rows: list[SamplingRow], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """One Exp(1) draw per token per row.

        A seeded row always takes exactly vocab_size draws from its own generator, so its token
        stream depends only on its seed and its own history, never on its batch neighbours.
        Unseeded rows share the default generator in a single batched draw.
        """
        noise = torch.empty(len(rows), vocab_size, device=device)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i : i + 1] = _exponentials(1, vocab_size, row.generator).to(device)
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        if unseeded:
            if self.default_generator is None:
                draws = torch.empty(len(unseeded), vocab_size, device=device).exponential_()
            else:
                draws = _exponentials(len(unseeded), vocab_size, self.default_generator)
            noise[unseeded] = draws.to(device)
        return noise


def _exponentials(num_rows: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    # Drawn on the generator's own device, so a CPU generator gives the same stream whether the
    # logits live on the CPU or a GPU.
    draws = torch.empty(num_rows, vocab_size, device=generator.device)
    return draws.exponential_(generator=generator)


def rank_tokens(
    scores: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """Per row of `scores` (logprobs, or logits): token_ids[row]'s score and rank, and the
    num_top[row] best (token id, score), best first (-1: the whole row). Shared by sampled
    tokens and prompt tokens (prompt_logprobs)."""
    vocab_size = scores.shape[-1]
    num_top = [vocab_size if count == -1 else min(count, vocab_size) for count in num_top]
    chosen = scores.gather(1, token_ids.unsqueeze(1))
    # Rank 1 is the best token; equal scores share the better rank.
    ranks = (scores > chosen).sum(dim=-1) + 1
    top_values, top_ids = scores.topk(max(num_top), dim=-1)
    return [
        TokenLogprobs(
            sampled_token_id=token_id,
            sampled_logprob=value,
            sampled_rank=rank,
            top=list(zip(ids[:count], values[:count], strict=True)),
        )
        for token_id, value, rank, ids, values, count in zip(
            token_ids.tolist(),
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
            num_top,
            strict=True,
        )
    ]


def prompt_token_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], num_top: int
) -> list[TokenLogprobs]:
    """Prompt logprobs of consecutive positions: row i of the model's logits scores the prompt
    token that follows it, next_token_ids[i], under the model's own distribution (raw, like
    vLLM's: no request's sampling settings apply to a prompt)."""
    token_ids = torch.tensor(next_token_ids, device=logits.device)
    return rank_tokens(logits.float().log_softmax(dim=-1), token_ids, [num_top] * len(token_ids))


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _empty_rows(logits: torch.Tensor) -> list[bool]:
    """Per row, whether every logit is -inf: nothing can be sampled there."""
    return logits.isneginf().all(dim=-1).tolist()


def _stop_ids_still_banned(row: SamplingRow) -> list[int]:
    """The eos and stop ids a row may not produce yet, because it is still short of min_tokens."""
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    return [*row.eos_token_ids, *row.params.stop_token_ids]


def _param_tensor(
    rows: list[SamplingRow], name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One SamplingParams field gathered across the batch, as a [rows] tensor."""
    return torch.tensor([getattr(row.params, name) for row in rows], dtype=dtype, device=device)


def _token_counts(
    token_ids_per_row: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab] float tensor: how often each token id occurs in each row's list.

    One bincount for the whole batch, on the device: row r's token t is counted at r * vocab + t.
    (A bincount per row on the host, stacked, would move rows x vocab counts to the GPU: 100 MB
    for 256 rows of a 49k vocabulary.) Ids past the logits' vocabulary have no logit to
    penalise and are left out."""
    num_rows = len(token_ids_per_row)
    lengths = torch.tensor([len(ids) for ids in token_ids_per_row])
    ids = torch.tensor(list(itertools.chain.from_iterable(token_ids_per_row)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(num_rows), lengths)
    in_vocab = ids < vocab_size
    flat_index = (rows * vocab_size + ids)[in_vocab].to(device)
    counts = torch.bincount(flat_index, minlength=num_rows * vocab_size)
    return counts.view(num_rows, vocab_size).float()
