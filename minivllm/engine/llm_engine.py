"""Chapter 04 — the engine: requests in, one scheduler step and one forward pass at a time, outputs out.

    engine = LLMEngine.from_config(EngineConfig())
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step():          # every request that got a token this step
            print(output.request_id, output.outputs[0].text, output.finished)

`step()` is one turn of the loop:

    Scheduler.schedule()          -> SchedulerOutput (plain data: who runs, how many tokens)
    Executor.execute_model(...)   -> ModelRunnerOutput (plain data: the sampled tokens)
    Scheduler.update_from_output  -> append tokens, check stop rules, free finished requests
    -> RequestOutput for every request that advanced (text detokenized incrementally)

The scheduler picks tokens under the budget (allocating KV blocks, preempting if needed); the
executor hands the step to the worker(s), whose model runner runs it as one flat batch over the
paged cache. The engine keeps everything that has to do with text and users (tokenizer,
detokenizers, stop strings, outputs); the workers keep the model and the pool. (Chapter 09's
server runs its requests with `detokenize=False`: its front end makes the text.)
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config import EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler, SchedulerConfig
from minivllm.engine.processor import Processor
from minivllm.executor.base import UniProcExecutor
from minivllm.executor.multiproc import MultiprocExecutor
from minivllm.models.loader import load_model_config, load_tokenizer, resolve_model_path
from minivllm.outputs import ModelRunnerOutput, RequestOutput
from minivllm.sample.sampling_params import SamplingParams
from minivllm.worker.worker import engine_max_model_len


@dataclass
class Metric:
    """One engine metric, named as vLLM names it, so tools built for vLLM's metrics read it."""

    name: str
    kind: str  # "gauge" or "counter"
    value: float
    description: str


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model_config = load_model_config(self.model_path)
        # The model and its KV pool live in the workers; the engine keeps the requests.
        if config.tensor_parallel_size > 1:
            # Checked here, before any process starts: a split that does not fit the heads.
            self.model_config.check_tensor_parallel_size(config.tensor_parallel_size)
            self.executor = MultiprocExecutor(config, self.model_path)
        else:
            self.executor = UniProcExecutor(config, self.model_path)
        num_blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.kv_cache_bytes_per_block = self.executor.kv_cache_bytes_per_block()
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.max_model_len = engine_max_model_len(
            config, self.model_config.max_model_len, num_blocks
        )

        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                policy=config.scheduling_policy,
                enable_chunked_prefill=config.enable_chunked_prefill,
                num_lookahead_tokens=(
                    0 if config.speculative is None else config.speculative.num_lookahead_tokens
                ),
                drafts_are_sampled=(
                    config.speculative is not None and config.speculative.uses_draft_model
                ),
            ),
            self.kv_cache_manager,
        )
        self.processor = Processor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.eos_token_ids = eos_token_ids(self.model_config.hf_config, self.tokenizer)
        self.requests: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.num_prompt_tokens = 0
        self.last_step_prefix_cache = (0, 0)  # (queries, hits) of the last step
        self.structured_output_manager = None  # chapter 10: built by the first grammar

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    def shutdown(self) -> None:
        """Stop the worker processes, if any (also done when the engine is garbage-collected
        and at exit), and the grammar compile thread."""
        self.executor.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()

    # --- requests ---

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request (a string, {"prompt": ...} or {"prompt_token_ids": ...}).
        Raises ValueError/TypeError for bad input; nothing is queued then."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed, params = self.processor.process_request(prompt, params)
        grammars = self._grammars(params)  # chapter 10: raises for a spec that does not parse
        sequences = []
        for index in range(params.n):
            # "id#index" names each sequence uniquely: the part after the last "#" is an int,
            # so no two (request id, index) pairs give the same name.
            sequence = Request.create(
                f"{request_id}#{index}",
                processed.text,
                processed.token_ids,
                params.for_completion(index),
                self.tokenizer,
                self.eos_token_ids,
                self.max_model_len,
                index=index,
            )
            sequence.parent_request_id = request_id
            sequence.priority = priority
            sequence.cache_salt = processed.cache_salt
            sequence.grammar = grammars[index]
            sequences.append(sequence)
        self.requests[request_id] = sequences
        for sequence in sequences:
            self.scheduler.add_request(sequence)

    def _grammars(self, params: SamplingParams) -> list:
        """Chapter 10: one grammar state per sequence of the request (None without structured
        outputs). The manager, and xgrammar, are loaded on first use."""
        if params.structured_outputs is None:
            return [None] * params.n
        if self.structured_output_manager is None:
            from minivllm.structured_output.manager import StructuredOutputManager

            self.structured_output_manager = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size
            )
        manager = self.structured_output_manager
        return [manager.grammar_for(params.structured_outputs) for _ in range(params.n)]

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are (waiting, mid-prefill, decoding); frees their blocks."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            for sequence in self.requests.pop(rid, []):
                if not sequence.is_finished:
                    self.scheduler.abort_request(sequence)

    def abort_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """Stop single sequences (request id, index) whose siblings go on; frees their blocks.
        Chapter 09's front end calls it when it finds a stop string in one sequence of an
        n > 1 request. A request whose last sequence this stops is forgotten."""
        for request_id, index in sequences:
            siblings = self.requests.get(request_id, [])
            if index < len(siblings) and not siblings[index].is_finished:
                self.scheduler.abort_request(siblings[index])
            if siblings and all(sibling.is_finished for sibling in siblings):
                del self.requests[request_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """True while requests run or wait, and for one more step after the last one ends,
        in which the runner is told to forget it."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # --- the loop ---

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward pass; outputs of requests that advanced."""
        stats = self.scheduler.prefix_cache_stats
        queries_before, hits_before = stats.queries, stats.hits
        scheduler_output = self.scheduler.schedule()
        self.last_step_prefix_cache = (stats.queries - queries_before, stats.hits - hits_before)
        if scheduler_output.is_empty:
            # Nothing runs; requests that ended before running (a grammar that failed to
            # compile) still report.
            runner_output = ModelRunnerOutput()
        else:
            runner_output = self.executor.execute_model(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        parent_ids: dict[str, None] = {}  # requests that advanced, in order, once each
        for sequence in updated:
            if len(sequence.output_token_ids) == 1:
                self.num_prompt_tokens += len(sequence.prompt_token_ids)
            parent_ids[sequence.parent_request_id] = None
        outputs = [self._request_output(parent_id) for parent_id in parent_ids]
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return outputs

    def _request_output(self, request_id: str) -> RequestOutput:
        sequences = self.requests[request_id]
        first = sequences[0]
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[s.completion_output() for s in sequences],
            finished=all(s.is_finished for s in sequences),
            metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
            # Completion 0 scores the shared prompt (SamplingParams.for_completion).
            prompt_logprobs=first.prompt_logprobs if first.has_all_prompt_logprobs else None,
        )

    # --- metrics ---

    def get_metrics(self) -> list[Metric]:
        scheduler = self.scheduler
        cache = scheduler.prefix_cache_stats
        step_queries, step_hits = self.last_step_prefix_cache
        rows = [
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                self.kv_cache_manager.usage,  # 0 when idle: waiting requests hold no blocks
                "Share of KV blocks held by live requests",
            ),
            (
                "minivllm:kv_cache_bytes",
                "gauge",
                self.kv_cache_manager.num_blocks * self.kv_cache_bytes_per_block,
                "Bytes of the KV pool",
            ),
            (
                "minivllm:kv_cache_touched_bytes",
                "gauge",
                self.kv_cache_manager.pool.num_blocks_touched * self.kv_cache_bytes_per_block,
                "Bytes of the KV blocks written at least once (on a CPU, the part of the pool "
                "that is resident: its pages are allocated when first written)",
            ),
            ("vllm:num_requests_running", "gauge", len(scheduler.running), "Requests running"),
            ("vllm:num_requests_waiting", "gauge", len(scheduler.waiting), "Requests waiting"),
            ("vllm:num_preemptions", "counter", scheduler.num_preemptions, "Preemptions so far"),
            ("vllm:prompt_tokens", "counter", self.num_prompt_tokens, "Prompt tokens processed"),
            (
                "vllm:generation_tokens",
                "counter",
                scheduler.num_generated_tokens,
                "Generated tokens",
            ),
            ("vllm:prefix_cache_queries", "counter", cache.queries, "Prompt tokens looked up"),
            ("vllm:prefix_cache_hits", "counter", cache.hits, "Prompt tokens found cached"),
            ("minivllm:prefix_cache_hit_rate", "gauge", cache.hit_rate, "hits / queries, so far"),
            (
                "minivllm:prefix_cache_hit_rate_last_step",
                "gauge",
                step_hits / step_queries if step_queries else 0.0,
                "hits / queries of the requests admitted in the last step",
            ),
        ]
        if self.config.speculative_config is not None:
            rows += spec_decode_metric_rows(scheduler.spec_decode_stats)
        return [Metric(*row) for row in rows]


def spec_decode_metric_rows(stats) -> list[tuple]:
    """Chapter 08's counters under vLLM's names, and the two numbers they are read for: how
    many drafts survive, and how many tokens a verification step yields on average."""
    rows = [
        ("vllm:spec_decode_num_drafts", "counter", stats.num_drafts, "Verification steps"),
        ("vllm:spec_decode_num_draft_tokens", "counter", stats.num_draft_tokens, "Draft tokens"),
        (
            "vllm:spec_decode_num_accepted_tokens",
            "counter",
            stats.num_accepted_tokens,
            "Draft tokens accepted",
        ),
        (
            "minivllm:spec_decode_acceptance_rate",
            "gauge",
            stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0,
            "accepted / draft tokens, so far",
        ),
        (
            "minivllm:spec_decode_mean_accepted_length",
            "gauge",
            1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 0.0,
            "tokens a verification step emits on average (accepted drafts + 1)",
        ),
    ]
    for position, accepted in enumerate(stats.accepted_per_position):
        rows.append(
            (
                f'vllm:spec_decode_num_accepted_tokens_per_pos{{position="{position}"}}',
                "counter",
                accepted,
                f"Drafts accepted at position {position}",
            )
        )
    return rows


def eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    """EOS ids from the model config (an int or a list) and the tokenizer, deduplicated."""
    ids = getattr(hf_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
