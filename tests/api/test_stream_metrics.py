"""The streams' gathered ITL counts (server/api/metrics.py _Buckets) reach prometheus_client's histograms as
the same buckets, count and sum as one observe() per observation would (values on the bounds included)."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest

from server.api.metrics import _LATENCY, _Buckets


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
    direct = Histogram("a", "a", labels, buckets=_LATENCY, registry=None)
    gathered = Histogram("a", "a", labels, buckets=_LATENCY, registry=None)
    d, g = (direct.labels("m"), gathered.labels("m")) if labelled else (direct, gathered)
    pending = _Buckets(_LATENCY)
    for i, v in enumerate(values):
        times = 1 + i % 3
        for _ in range(times):
            d.observe(v)
        pending.add(v, times)
        if i % 100 == 99:  # scrapes in between: each flush adds only what is new
            pending.flush(g)
    pending.flush(g)
    pending.flush(g)  # nothing new: nothing added
    want, got = _samples(direct), _samples(gathered)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
