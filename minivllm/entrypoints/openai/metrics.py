"""`GET /metrics`: what the server is doing, in Prometheus' text format, under vLLM's names.

Two sources. The engine already counts what it does (`LLMEngine.get_metrics()`: KV-cache
usage, running and waiting requests, preemptions, prompt and generated tokens, prefix-cache
queries and hits), and a collector reads those at scrape time. The latencies a user feels are
measured here, where outputs leave the engine: time to first token, the gap between two
tokens, and a request's whole life, as histograms, plus finished requests by reason.

Every app gets its own `CollectorRegistry`, so several servers can live in one process.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minivllm.engine.async_llm import AsyncLLM
from minivllm.outputs import RequestOutput

# vLLM's bucket bounds (seconds), so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
E2E_BUCKETS += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# An engine metric's name may carry labels: 'vllm:x{position="0"}'.
LABELLED_NAME = re.compile(r"^([^{]+)(?:\{(.*)\})?$")
LABEL = re.compile(r'(\w+)="([^"]*)"')


class EngineMetricsCollector(Collector):
    """The engine's own metrics, read at every scrape."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for metric in self.engine.get_metrics():
            name, labels_text = LABELLED_NAME.match(metric.name).groups()
            labels = {"model_name": self.model_name, **dict(LABEL.findall(labels_text or ""))}
            family = families.get(name)
            if family is None:
                kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
                family = families[name] = kind(name, metric.description, labels=list(labels))
            family.add_metric(list(labels.values()), metric.value)
        yield from families.values()


class RequestLatencyMetrics:
    """Latency histograms and finished-request counts, fed with every step's outputs (on the
    engine thread, so the times are when tokens came out, not when a client read them)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            labels,
            registry=registry,
            buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two consecutive outputs of a request",
            labels,
            registry=registry,
            buckets=ITL_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token",
            labels,
            registry=registry,
            buckets=E2E_BUCKETS,
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests, by why they finished",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.model_name = model_name
        self.last_output_time: dict[str, float] = {}  # unfinished request id -> its last output

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            last = self.last_output_time.pop(output.request_id, None)
            if last is None:
                self.ttft.observe(now - output.metrics.arrival_time)
            else:
                self.itl.observe(now - last)
            if output.finished:
                self.e2e.observe(now - output.metrics.arrival_time)
                reason = output.outputs[0].finish_reason
                self.success.labels(self.model_name, reason).inc()
            else:
                self.last_output_time[output.request_id] = now

    def on_abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.last_output_time.pop(request_id, None)


def make_registry(engine: AsyncLLM, model_name: str) -> CollectorRegistry:
    """A registry with the engine's metrics and the latency metrics, wired to the engine."""
    registry = CollectorRegistry()
    registry.register(EngineMetricsCollector(engine, model_name))
    engine.add_listener(RequestLatencyMetrics(registry, model_name))
    return registry
