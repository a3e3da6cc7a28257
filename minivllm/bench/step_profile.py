"""Chapter 11 — the anatomy of a step: where one engine step's time goes.

A step is five kinds of work, and only one of them is the model:

    schedule   the scheduler decides who runs and grants tokens and blocks  (core/scheduler.py)
    prepare    the runner updates its requests and lays out the flat batch  (worker/input_batch.py)
    forward    the model on the batch, attention included                   (models/llama.py)
    sample     logits of the sampled rows and the sampler                    (sample/sampler.py)
    outputs    the scheduler takes the tokens in, request outputs are made   (engine/llm_engine.py)

`profile_steps` times each part of every step of a workload, by wrapping the engine's own
methods (on this engine only, for the duration of the run), so the numbers are the real
engine's, not a copy's. On a GPU each part ends with a synchronize, so a kernel's time is
counted where it is launched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest.mock import patch

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "outputs")


@dataclass
class StepTimes:
    """Seconds of every phase, summed over the steps measured."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_steps: int = 0

    def per_step_ms(self) -> dict[str, float]:
        return {phase: 1e3 * s / max(self.num_steps, 1) for phase, s in self.seconds.items()}


class _Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def wrap(self, function: Callable, totals: dict[str, float], phase: str) -> Callable:
        """`function`, adding the seconds of each call to totals[phase]."""

        def timed(*args, **kwargs):
            start = self.now()
            try:
                return function(*args, **kwargs)
            finally:
                totals[phase] += self.now() - start

        return timed


def profile_steps(llm, prompts: list[dict], params) -> StepTimes:
    """Run `prompts` to completion on `llm` (an `LLM` whose engine runs in this process: no
    tensor or data parallelism) and return the time of each phase over all its steps."""
    engine = llm.llm_engine
    runner = engine.executor.driver_worker.model_runner
    scheduler = engine.scheduler
    timer = _Timer(runner.device)
    # Measured directly: the step, the scheduler's decision, the runner's whole call and the
    # three parts inside it (the forward, or its CUDA-graph replay; the logits; the sampler).
    # "prepare" is the runner's time outside those three; "outputs" the step's time outside
    # the decision and the runner.
    measured = dict.fromkeys(("step", "schedule", "runner", "forward", "logits", "sampler"), 0.0)
    sampler = runner.sampler
    timed_call = timer.wrap(sampler, measured, "sampler")

    class TimedSampler:
        """The runner's sampler, its call timed; the methods speculation uses pass through."""

        def __call__(self, *args):
            return timed_call(*args)

        def __getattr__(self, name):
            return getattr(sampler, name)

    for request_id, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(f"profile-{request_id}", prompt, request_params)
    # Each patch replaces an attribute of this engine's objects for the run only (an instance
    # attribute shadowing the method), then puts back what was there.
    with (
        patch.object(scheduler, "schedule", timer.wrap(scheduler.schedule, measured, "schedule")),
        patch.object(runner, "execute_model", timer.wrap(runner.execute_model, measured, "runner")),
        patch.object(runner, "run_forward", timer.wrap(runner.run_forward, measured, "forward")),
        patch.object(
            runner.model,
            "compute_logits",
            timer.wrap(runner.model.compute_logits, measured, "logits"),
        ),
        patch.object(runner, "sampler", TimedSampler()),
    ):
        steps = 0
        while engine.has_unfinished_requests():
            start = timer.now()
            engine.step()
            measured["step"] += timer.now() - start
            steps += 1
    inside_runner = measured["forward"] + measured["logits"] + measured["sampler"]
    return StepTimes(
        seconds=dict(
            schedule=measured["schedule"],
            prepare=measured["runner"] - inside_runner,
            forward=measured["forward"],
            sample=measured["logits"] + measured["sampler"],
            outputs=measured["step"] - measured["schedule"] - measured["runner"],
        ),
        num_steps=steps,
    )
