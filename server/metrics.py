"""Prometheus metrics (GET /metrics).

Two kinds: what the HTTP layer sees happen (tokens, latencies, sleep/wake transitions) is counted
as it happens; what the engine *is* (queue lengths, KV blocks, sleep state, pool bytes) is read
fresh at every scrape by a collector, so the API layer never keeps a copy of engine state.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.api.state import ENGINE_STATES, engine_state_name
from server.engine.outputs import RequestOutput

P = "sleepserve_"
TAGS = ("weights", "kv_cache", "cuda_graph")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TRANSITION = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RequestTracker:
    """Per-request timing: TTFT, inter-token latency, tokens, outcome."""

    def __init__(self, metrics: "ServerMetrics", start: float):
        self.m = metrics
        self.start = start
        self.last_token: float | None = None
        self.prompt_counted = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if not self.prompt_counted:
            self.prompt_counted = True
            self.m.prompt_tokens.inc(len(out.prompt_token_ids))
        new = sum(len(o.delta_token_ids) for o in out.outputs)
        if not new:
            return
        self.m.generation_tokens.inc(new)
        if self.last_token is None:
            self.m.ttft.observe(now - self.start)
        else:
            self.m.itl.observe(now - self.last_token)
        self.last_token = now

    def finish(self, last: RequestOutput | None) -> None:
        if last is None or not last.finished:
            reason = "rejected" if last is None else "disconnected"  # refused at admission, or client left
        else:
            reason = last.outputs[0].finish_reason if last.outputs else "stop"
        self.m.finished.labels(reason or "stop").inc()
        self.m.e2e.observe(time.monotonic() - self.start)


class ServerMetrics:
    def __init__(self, engine: Any):
        self.engine = engine
        # Unregistered on purpose: each scrape assembles its own registry (see render).
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests", registry=None)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=None)
        self.finished = Counter(P + "requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=None)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY, registry=None)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between a request's successive tokens",
                             buckets=_LATENCY, registry=None)
        self.e2e = Histogram(P + "request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY, registry=None)
        self.sleep_seconds = Histogram(P + "sleep_seconds", "Duration of sleep calls", ["level"],
                                       buckets=_TRANSITION, registry=None)
        self.wake_seconds = Histogram(P + "wake_seconds", "Duration of wake calls, by the level slept at",
                                      ["level"], buckets=_TRANSITION, registry=None)
        self.bytes_offloaded = Counter(P + "sleep_offloaded_bytes", "Bytes backed up to the host by sleeps",
                                       registry=None)
        self.bytes_discarded = Counter(P + "sleep_discarded_bytes", "Bytes released without backup by sleeps",
                                       registry=None)
        self.bytes_restored = Counter(P + "wake_restored_bytes", "Bytes copied back by wakes", registry=None)
        self._own = [self.prompt_tokens, self.generation_tokens, self.finished, self.ttft, self.itl, self.e2e,
                     self.sleep_seconds, self.wake_seconds, self.bytes_offloaded, self.bytes_discarded,
                     self.bytes_restored]
        self._last_sleep_level = "unknown"
        engine.on_transition.append(self.on_transition)

    def track(self, start: float) -> RequestTracker:
        return RequestTracker(self, start)

    def on_transition(self, kind: str, report: dict) -> None:
        """Called on the engine thread after each sleep and wake (prometheus-client is thread-safe)."""
        if kind == "sleep":
            self._last_sleep_level = str(report.get("level"))
            self.sleep_seconds.labels(self._last_sleep_level).observe(report.get("seconds", 0.0))
            self.bytes_offloaded.inc(report.get("bytes_offloaded", 0))
            self.bytes_discarded.inc(report.get("bytes_discarded", 0))
        elif kind == "wake":
            self.wake_seconds.labels(self._last_sleep_level).observe(report.get("seconds", 0.0))
            self.bytes_restored.inc(report.get("bytes_restored", 0))

    def render(self, pool: dict | None) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        for metric in self._own:
            registry.register(metric)
        registry.register(EngineCollector(self.engine.state, asdict(self.engine.stats), pool))
        return generate_latest(registry)


class EngineCollector:
    """Gauges read from one scrape's snapshot of the engine (and of the pool, when it answered)."""

    def __init__(self, state: dict, stats: dict, pool: dict | None):
        self.state, self.stats, self.pool = state, stats, pool

    def collect(self) -> Iterable[Metric]:
        s, st = self.stats, self.state

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, doc, value=value)

        yield gauge("requests_running", "Sequences in the running batch", s["running"])
        yield gauge("requests_waiting", "Sequences waiting to be scheduled", s["waiting"])
        yield gauge("kv_cache_blocks_used", "KV-cache blocks in use", s["kv_blocks_used"])
        yield gauge("kv_cache_blocks_total", "KV-cache blocks in the pool", s["kv_blocks_total"])
        total = s["kv_blocks_total"]
        yield gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", s["kv_blocks_used"] / total
                    if total else 0.0)
        queried, hit = s["prefix_cache_queried_tokens"], s["prefix_cache_hit_tokens"]
        yield CounterMetricFamily(P + "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=queried)
        yield CounterMetricFamily(P + "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  value=hit)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits over lookups, since start", hit / queried
                    if queried else 0.0)
        yield CounterMetricFamily(P + "preemptions", "Sequences preempted for lack of KV blocks",
                                  value=s["preemptions"])

        current = engine_state_name(st)
        states = GaugeMetricFamily(P + "engine_state", "1 for the engine's current state", labels=["state"])
        for name in ENGINE_STATES:
            states.add_metric([name], 1.0 if name == current else 0.0)
        yield states
        level = st.get("level")
        yield gauge("sleep_level", "Level of the current sleep or pause; -1 when awake", -1 if level is None
                    else level)
        asleep = GaugeMetricFamily(P + "tag_asleep", "1 while the tag's memory sleeps", labels=["tag"])
        for tag in TAGS:
            asleep.add_metric([tag], 1.0 if tag in st.get("sleeping_tags", ()) else 0.0)
        yield asleep
        yield gauge("weights_valid", "0 after weights were discarded until they are loaded again",
                    1.0 if st.get("weights_valid", True) else 0.0)

        if self.pool is not None:
            by_tag = GaugeMetricFamily(P + "pool_bytes", "Bytes reserved in the memory pool, by tag",
                                       labels=["tag", "state"])
            for tag, t in sorted(self.pool.get("tags", {}).items()):
                by_tag.add_metric([tag, t["state"]], t["bytes"])
            yield by_tag
            yield gauge("pool_host_backup_bytes", "Host memory (or disk, on CPU) holding backups",
                        self.pool.get("host_backup_bytes", 0))
            yield gauge("device_memory_free_bytes", "Free device memory", self.pool.get("device_free", 0))
            yield gauge("device_memory_total_bytes", "Total device memory", self.pool.get("device_total", 0))
