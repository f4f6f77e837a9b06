"""The streams' gathered ITL counts (server/api/metrics.py _Unscraped.add_itl, _Buckets) reach prometheus_client's
histograms, ours and vLLM's, as the same buckets, count and sum as one observe() per observation would (values on
the bounds included)."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest

from server.api.metrics import _LATENCY, _Unscraped


def _samples(h: Histogram) -> dict:
    reg = CollectorRegistry()
    reg.register(h)
    text = generate_latest(reg).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("labelled", [False, True])
def test_gathered_buckets_match_observe(labelled):
    rng = random.Random(3)
    values = list(_LATENCY) + [0.0, 1e-9, 79.99, 80.0, 80.01, 1e6] + [rng.expovariate(20) for _ in range(300)]
    labels = ["model_name"] if labelled else []
    # ours and vLLM's ITL histograms: observed one by one, and gathered
    direct = [Histogram("a", "a", labels, buckets=_LATENCY, registry=None) for _ in range(2)]
    gathered = [Histogram("a", "a", labels, buckets=_LATENCY, registry=None) for _ in range(2)]
    d_ours, d_vllm, g_ours, g_vllm = (h.labels("m") if labelled else h for h in direct + gathered)
    pending = _Unscraped()

    def flush() -> None:
        pending.itl.flush(g_ours)
        pending.v_itl.flush(g_vllm)

    for i, v in enumerate(values):
        steps, tokens = 1 + i % 3, 1 + i % 5  # vLLM's counts each token of each sequence
        for _ in range(steps):
            d_ours.observe(v)
        for _ in range(tokens):
            d_vllm.observe(v)
        pending.add_itl(v, steps, tokens)
        if i % 100 == 99:  # scrapes in between: each flush adds only what is new
            flush()
    flush()
    flush()  # nothing new: nothing added
    for d, g in zip(direct, gathered):
        want, got = _samples(d), _samples(g)
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12), key
