"""Prometheus metrics (GET /metrics): ours (sleepserve_*) and vLLM's (vllm:*, with vLLM's names and its
`model_name` and `engine` labels, so dashboards written for vLLM read this server unchanged).

Two kinds: what happens (tokens, latencies, steps, sleep/wake transitions) is counted as it happens;
what the engine *is* (queue lengths, KV blocks, sleep state, pool bytes) is read fresh at every scrape
by a collector, so this module keeps no copy of engine state.
"""
from __future__ import annotations

import asyncio
import os
import time
from bisect import bisect_left
from dataclasses import asdict
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.wire.outputs import RequestOutput
from server.wire.params import SamplingParams
from server.wire.sleep_state import ENGINE_STATES, SleepReport, SleepState
from server.wire.tags import ALL_TAGS

P = "sleepserve_"
V = "vllm:"
ENGINE_INDEX = "0"  # vLLM labels each engine core; this server has one
VLLM_SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TRANSITION = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets for the same families.
_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N = (1, 2, 5, 10, 20)
_PREEMPTIONS = (0, 1, 2, 5, 10, 20, 50, 100)
WAITING_REASONS = ("capacity", "deferred")  # vLLM's: no KV room yet | held back by a constraint (none here)


class _Buckets:
    """Observations of one histogram not yet added to it: counts per bucket and their sum (_Unscraped.add_itl
    fills them). Histogram.observe takes a lock twice and walks the bounds per call; a stream observes per
    request per engine step, so the counts gather here and reach the histogram at the next scrape."""
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds + (float("inf"),)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def flush(self, histogram: Any) -> None:
        """Into a prometheus_client Histogram (or a labelled child): its buckets and sum, as `times`
        calls of observe(value) each would have left them (tests/api/test_stream_metrics.py checks it)."""
        if not any(self.counts):
            return
        assert tuple(histogram._upper_bounds) == self.bounds, "the histogram's buckets changed"
        for i, c in enumerate(self.counts):
            if c:
                histogram._buckets[i].inc(c)
                self.counts[i] = 0
        histogram._sum.inc(self.total)
        self.total = 0.0


class _Unscraped:
    """What the streams counted since the last scrape (see _Buckets): generated tokens, both ITL histograms."""

    def __init__(self) -> None:
        self.generated = 0
        self.itl = _Buckets(_LATENCY)
        self.v_itl = _Buckets(_LATENCY)

    def add_itl(self, interval: float, steps: int, tokens: int) -> None:
        """One output's inter-token interval: `steps` times into ours, `tokens` times into vLLM's. Both have
        the same bounds, so one search finds the bucket of both (the first bound >= interval: observe's)."""
        itl, v_itl = self.itl, self.v_itl
        i = bisect_left(itl.bounds, interval)
        itl.counts[i] += steps
        itl.total += interval * steps
        v_itl.counts[i] += tokens
        v_itl.total += interval * tokens


class RequestTracker:
    """Per-request timing: TTFT, inter-token latency, tokens, outcome, and vLLM's per-request histograms."""

    def __init__(self, metrics: "ServerMetrics", start: float, params: SamplingParams | None):
        self.m = metrics
        self.start = start
        self.params = params
        self.last_token: float | None = None
        self.prompt_tokens: int | None = None
        self.generated = 0

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.m
        if self.prompt_tokens is None:
            self.prompt_tokens = len(out.prompt_token_ids)
            m.prompt_tokens.inc(self.prompt_tokens)
            m.v_prompt_tokens.inc(self.prompt_tokens)
        outs = out.outputs
        if len(outs) == 1:  # n = 1, most requests: no list of counts (a stream observes once per chunk)
            new = steps = len(outs[0].delta_token_ids)
        else:
            counts = [len(o.delta_token_ids) for o in outs]
            new, steps = sum(counts), max(counts, default=0)
        if not new:
            return
        self.generated += new
        m.pending.generated += new
        if self.last_token is None:
            m.ttft.observe(now - self.start)
            m.v_ttft.observe(now - self.start)
        else:
            # An output may span several steps (a FINAL_ONLY request's last one spans all but the first; a
            # slow reader merges steps): one interval per step, the mean, and vLLM's histogram one per token
            # of each sequence (its n sequences are n requests there).
            m.pending.add_itl((now - self.last_token) / steps, steps, new)
        self.last_token = now

    def finish(self, last: RequestOutput | None) -> None:
        m = self.m
        if last is None or not last.finished:
            reason = "rejected" if last is None else "disconnected"  # refused at admission, or client left
        else:
            reason = last.outputs[0].finish_reason if last.outputs else "stop"
        m.finished.labels(reason or "stop").inc()
        if last is not None:
            # vLLM counts each of a request's n sequences (its child requests) by how it ended; a client that
            # left is an abort there (the engine aborts it). A request refused at admission never ran: not counted.
            for o in last.outputs:
                m.v_success.labels(m.model_name, ENGINE_INDEX, o.finish_reason if last.finished else "abort").inc()
        if m.shared:  # a scrape of another API process then counts every finished request's tokens
            m.flush()
        elapsed = time.monotonic() - self.start
        m.e2e.observe(elapsed)
        if last is None or not last.finished:
            return  # vLLM's per-request histograms count finished requests
        m.v_e2e.observe(elapsed)
        m.v_prompt_hist.observe(self.prompt_tokens or 0)
        m.v_generation_hist.observe(self.generated)
        if self.params is not None:
            m.v_params_n.observe(self.params.n)
            if self.params.max_tokens is not None:
                m.v_params_max_tokens.observe(self.params.max_tokens)
        t = last.metrics
        if t is not None:
            m.v_preemptions.observe(t.num_preemptions)
        if t is not None and t.first_scheduled_time is not None:
            m.v_queue.observe(t.first_scheduled_time - t.arrival_time)
            if t.last_token_time is not None:
                m.v_inference.observe(t.last_token_time - t.first_scheduled_time)
            if t.first_token_time is not None:
                m.v_prefill.observe(t.first_token_time - t.first_scheduled_time)
                if t.last_token_time is not None:
                    m.v_decode.observe(t.last_token_time - t.first_token_time)


def share_metrics(folder: str) -> None:
    """This process and the API processes it starts (--api-server-count; they inherit the variable) keep what
    they count in files of `folder`, which every scrape sums (prometheus_client's multiprocess mode). Before
    any ServerMetrics is made."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    values.ValueClass = values.MultiProcessValue()


class ServerMetrics:
    def __init__(self, engine: Any, model_name: str, shared: bool = False):
        """shared: several API processes count (share_metrics ran): a scrape reads every process's files."""
        self.engine = engine
        self.model_name = model_name
        self.shared = shared
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
        own = [self.prompt_tokens, self.generation_tokens, self.finished, self.ttft, self.itl, self.e2e,
               self.sleep_seconds, self.wake_seconds, self.bytes_offloaded, self.bytes_discarded,
               self.bytes_restored]

        labels = ["model_name", "engine"]
        values = (model_name, ENGINE_INDEX)

        def counter(name: str, doc: str) -> Any:
            metric = Counter(V + name, doc, labels, registry=None)
            own.append(metric)
            return metric.labels(*values)

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            metric = Histogram(V + name, doc, labels, buckets=buckets, registry=None)
            own.append(metric)
            return metric.labels(*values)

        self.v_prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.v_generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.v_ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                _LATENCY)
        self.v_itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               _LATENCY)
        self.v_e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               _REQUEST_LATENCY)
        self.v_prompt_hist = histogram("request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS)
        self.v_generation_hist = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                           _TOKENS)
        self.v_params_n = histogram("request_params_n", "Histogram of the n request parameter.", _N)
        self.v_params_max_tokens = histogram("request_params_max_tokens",
                                             "Histogram of the max_tokens request parameter.", _TOKENS)
        self.v_queue = histogram("request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY)
        self.v_prefill = histogram("request_prefill_time_seconds",
                                   "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY)
        self.v_decode = histogram("request_decode_time_seconds",
                                  "Histogram of time spent in DECODE phase for request.", _REQUEST_LATENCY)
        self.v_inference = histogram("request_inference_time_seconds",
                                     "Histogram of time spent in RUNNING phase for request.", _REQUEST_LATENCY)
        self.v_preemptions = histogram("request_num_preemptions", "Number of preemptions per finished request.",
                                       _PREEMPTIONS)
        self.v_iteration = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     _ITERATION)
        # Labelled by finish reason beside vLLM's two labels: its children are made per scrape's reason.
        self.v_success = Counter(V + "request_success", "Count of successfully processed requests.",
                                 [*labels, "finished_reason"], registry=None)
        own.append(self.v_success)
        self._own = own
        self.pending = _Unscraped()
        engine.on_transition.append(self.on_transition)
        engine.on_step.append(self.v_iteration.observe)

    def track(self, start: float, params: SamplingParams | None = None) -> RequestTracker:
        return RequestTracker(self, start, params)

    def on_transition(self, report: SleepReport) -> None:
        """Called on the event loop after each sleep and wake that changed something (the engine's
        reply carries the report). A wake's level is the level it woke from."""
        if report.action == "sleep":
            self.sleep_seconds.labels(str(report.level)).observe(report.seconds)
            self.bytes_offloaded.inc(report.bytes_offloaded)
            self.bytes_discarded.inc(report.bytes_discarded)
        elif report.action == "wake_up":
            self.wake_seconds.labels(str(report.level)).observe(report.seconds)
            self.bytes_restored.inc(report.bytes_restored)

    def flush(self) -> None:
        """The counts the streams gathered since the last scrape, into the metrics a scrape reads."""
        p = self.pending
        if p.generated:
            self.generation_tokens.inc(p.generated)
            self.v_generation_tokens.inc(p.generated)
            p.generated = 0
        p.itl.flush(self.itl)
        p.v_itl.flush(self.v_itl)

    async def publish_every(self, seconds: float) -> None:
        """With several API processes a scrape reaches one of them, and reads the others' files: each
        publishes what its streams counted (flush) on its own, at least this often."""
        while True:
            await asyncio.sleep(seconds)
            self.flush()

    def render(self, ranks: list[dict] | None) -> bytes:
        """ranks: each rank's pool stats (one rank without tensor parallelism), None when not read."""
        self.flush()
        registry = CollectorRegistry(auto_describe=False)
        if self.shared:
            MultiProcessCollector(registry)
        else:
            for metric in self._own:
                registry.register(metric)
        info = self.engine.info
        registry.register(EngineCollector(self.engine.state, asdict(self.engine.stats), ranks,
                                          info.config, info.kv_plan, self.model_name, info.max_model_len))
        return generate_latest(registry)


class EngineCollector:
    """Gauges read from one scrape's snapshot of the engine (and of the pool, when it answered)."""

    def __init__(self, state: SleepState, stats: dict, ranks: list[dict] | None, config: Any, kv_plan: Any,
                 model_name: str, max_model_len: int):
        self.state, self.stats, self.ranks = state, stats, ranks
        self.pool = ranks[0] if ranks else None  # rank 0's pool (the only one without tensor parallelism)
        self.config, self.kv_plan, self.model_name = config, kv_plan, model_name
        self.max_model_len = max_model_len

    def collect(self) -> Iterable[Metric]:
        yield from self._ours()
        yield from self._vllm()

    def _ours(self) -> Iterable[Metric]:
        s, st = self.stats, self.state

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, doc, value=value)

        yield gauge("requests_running", "Sequences in the running batch", s["running"])
        yield gauge("batch_invariant", "1 when every reduction keeps one order whatever the batch (--batch-invariant)",
                    1.0 if getattr(self.config, "batch_invariant", False) else 0.0)
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

        states = GaugeMetricFamily(P + "engine_state", "1 for the engine's current state", labels=["state"])
        for name in ENGINE_STATES:
            states.add_metric([name], 1.0 if name == st.name else 0.0)
        yield states
        yield gauge("sleep_level", "Level of the current sleep or pause; -1 when awake",
                    -1 if st.level is None else st.level)
        asleep = GaugeMetricFamily(P + "tag_asleep", "1 while the tag's memory sleeps", labels=["tag"])
        for tag in ALL_TAGS:
            asleep.add_metric([tag], 1.0 if tag in st.asleep else 0.0)
        yield asleep
        yield gauge("weights_valid", "0 after weights were discarded until they are loaded again",
                    1.0 if st.weights_valid else 0.0)

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
            yield gauge("tensor_parallel_size", "Ranks of tensor parallelism (one process and pool each)",
                        len(self.ranks or ()))
            per_rank = GaugeMetricFamily(P + "rank_pool_bytes", "Bytes reserved in each rank's memory pool, by tag",
                                         labels=["rank", "tag", "state"])
            free = GaugeMetricFamily(P + "rank_device_memory_free_bytes", "Free device memory of each rank's device",
                                     labels=["rank"])
            for rank, pool in enumerate(self.ranks or ()):
                for tag, t in sorted(pool.get("tags", {}).items()):
                    per_rank.add_metric([str(rank), tag, t["state"]], t["bytes"])
                free.add_metric([str(rank)], pool.get("device_free", 0))
            yield per_rank
            yield free

    def _vllm(self) -> Iterable[Metric]:
        s, st = self.stats, self.state
        labels, values = ["model_name", "engine"], [self.model_name, ENGINE_INDEX]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(V + name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(V + name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Number of requests in model execution batches.", s["running"])
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", s["waiting"])
        by_reason = GaugeMetricFamily(V + "num_requests_waiting_by_reason", "Number of requests waiting by reason.",
                                      labels=[*labels, "reason"])
        # Every waiting sequence here waits for room in the batch or the KV cache; nothing defers one.
        for reason, n in zip(WAITING_REASONS, (s["waiting"], 0)):
            by_reason.add_metric([*values, reason], n)
        yield by_reason
        total = s["kv_blocks_total"]
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s["kv_blocks_used"] / total if total else 0.0)
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", s["preemptions"])
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s["prefix_cache_queried_tokens"])
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s["prefix_cache_hit_tokens"])

        info_labels = {"block_size": str(self.kv_plan.block_size), "num_gpu_blocks": str(self.kv_plan.num_blocks - 1),
                       "enable_prefix_caching": str(self.config.enable_prefix_caching),
                       "gpu_memory_utilization": str(self.config.gpu_memory_utilization),
                       "cache_dtype": "auto", "num_cpu_blocks": "0",
                       "kv_cache_size_tokens": str(self.kv_plan.capacity_tokens),
                       # requests of the full context the KV cache holds at once, as vLLM reports it
                       "kv_cache_max_concurrency": str(self.kv_plan.capacity_tokens / self.max_model_len)}
        info = GaugeMetricFamily(V + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*labels, *info_labels])
        info.add_metric([*values, *info_labels.values()], 1.0)
        yield info

        sleep = GaugeMetricFamily(V + "engine_sleep_state", "Engine sleep state: 1 for the current one (all 0 while "
                                  "paused, as vLLM's level 0)",
                                  labels=[*labels, "sleep_state"])
        for name in VLLM_SLEEP_STATES:
            sleep.add_metric([*values, name], 1.0 if name == st.vllm_sleep_state else 0.0)
        yield sleep
