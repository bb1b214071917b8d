"""``GET /metrics``: Prometheus' text format through ``prometheus_client``, one registry per app
(two apps in one process keep their own counts)."""

from __future__ import annotations

from typing import Callable, Mapping, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..continuous.engine import ENGINE_PHASES

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The endpoint's instruments."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("fastlora_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("fastlora_prompt_tokens", "Prompt tokens of the completions accepted",
                                     registry=registry)
        self.generation_tokens = Counter("fastlora_generation_tokens", "Tokens generated", registry=registry)
        self.completions = Counter("fastlora_completions", "Completions ended, by how they ended",
                                   ["outcome"], registry=registry)
        self.waiting = Gauge("fastlora_requests_waiting", "Completions accepted and queued in the engine",
                             registry=registry)
        self.running = Gauge("fastlora_requests_running", "Completions in the engine's batch (prefilling or "
                             "generating)", registry=registry)
        self.ttft = Histogram("fastlora_time_to_first_token_seconds", "From acceptance to the first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("fastlora_time_per_output_token_seconds",
                              "Between consecutive tokens of a completion (mean over the completion)",
                              buckets=_TOKEN_BUCKETS, registry=registry)
        self.latency = Histogram("fastlora_request_latency_seconds", "From acceptance to the last token",
                                 buckets=_LATENCY_BUCKETS, registry=registry)
        self.restarts = Counter("fastlora_engine_restarts", "Times the engine was restarted after it died",
                                registry=registry)

    def watch_engine(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Expose the engine's loop as ``read()`` gives it when scraped: its steps and the engine
        thread's seconds in each phase (``continuous.engine.ENGINE_PHASES``), summed over every
        manager the server ran."""
        self.registry.register(_EngineLoop(read))

    def render(self) -> Tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineLoop:
    """A collector of the engine's loop: whether the host or the GPU holds a step back shows in
    how its seconds split (``outputs`` includes the wait for the GPU's tokens)."""

    def __init__(self, read: Callable[[], Mapping[str, float]]):
        self.read = read

    def collect(self):
        clock = self.read()
        steps = CounterMetricFamily("fastlora_engine_steps", "Engine steps run (forwards with requests)")
        steps.add_metric([], clock.get("steps", 0))
        yield steps
        seconds = CounterMetricFamily("fastlora_engine_seconds", "The engine thread's wall time by phase of its loop",
                                      labels=["phase"])
        for phase in ENGINE_PHASES:
            seconds.add_metric([phase], clock.get(phase, 0.0))
        yield seconds
