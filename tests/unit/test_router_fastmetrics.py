"""The request path's lock-free series render as prometheus_client's own would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.fastmetrics import FastCounter, FastHistogram

BUCKETS = (0.00005, 0.0001, 0.001, 0.01, 0.5, 1, 30)
VALUES = (0.0, 0.00005, 0.00007, 0.001, 0.0011, 0.3, 1.0, 2.0, 31.0, 1e9)


def _lines(registry: CollectorRegistry) -> list[str]:
    # prometheus_client's histogram has a _created sample per series; ours does not (optional).
    # A counter's _created value is when its series was made: the name and labels are compared.
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if line.startswith("c_created") else line
            for line in lines if "h_created" not in line]


def test_the_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h1 = FastHistogram("h", "a histogram", ["model"], buckets=BUCKETS, registry=ours)
    h2 = Histogram("h", "a histogram", ["model"], buckets=BUCKETS, registry=theirs)
    c1 = FastCounter("c", "a counter", ["model", "status"], registry=ours)
    c2 = Counter("c", "a counter", ["model", "status"], registry=theirs)
    for i, v in enumerate(VALUES):
        model = "m1" if i % 3 else "m/2"
        h1.labels(model).observe(v)
        h2.labels(model).observe(v)
        c1.labels(model, "200").inc()
        c2.labels(model, "200").inc()
        c1.labels(model, "499").inc(2.5)
        c2.labels(model, "499").inc(2.5)
    assert _lines(ours) == _lines(theirs)
    assert ours.get_sample_value("h_bucket", {"model": "m1", "le": "0.001"}) == 2.0
    assert ours.get_sample_value("c_created", {"model": "m1", "status": "200"}) is not None


def test_refuses_what_prometheus_client_refuses() -> None:
    registry = CollectorRegistry()
    c = FastCounter("c", "a counter", ["model"], registry=registry)
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("m").inc(-1)
    with pytest.raises(ValueError, match="labels"):
        c.labels("m", "extra")
    with pytest.raises(ValueError, match="increasing"):
        FastHistogram("h", "h", [], buckets=(1, 0.5), registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        FastCounter("c", "again", ["model"], registry=registry)
