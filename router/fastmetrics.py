"""Counters and histograms for the request path, without a lock (decision 113).

``prometheus_client``'s series take a lock on every increment, and its histogram walks its
buckets in Python and checks its exemplar settings on every observation: a dozen calls per
request, and the ITL histogram on every streamed chunk. The router's request path runs on one
thread (its event loop), and so does ``/metrics``, so these series keep plain numbers: an
increment is an addition, an observation a ``bisect`` and two. They register with the router's
registry as a collector and render exactly as ``prometheus_client``'s own (the same names,
``_total``/``_bucket``/``_sum``/``_count`` samples, labels and bucket bounds; a counter also its
``_created``).

Not for any series a thread other than the event loop's updates.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

S = TypeVar("S")
F = TypeVar("F", bound=Metric)


class Count:
    """One counter series: ``inc`` adds."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class Observed:
    """One histogram series: ``counts[i]`` observations fell in bucket ``i`` (its upper bound
    ``bounds[i]`` included; the last bucket is +Inf), their ``sum``."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family(Collector, Generic[S, F]):
    """A labelled metric's series (``S``), each made on first use (:meth:`_new`) and kept, rendered
    as one family (``F``) of samples, one :meth:`_add` per series."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], S] = {}
        registry.register(self)

    def labels(self, *values: str) -> S:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames} expected, got {values}")
            series = self._series[values] = self._new()
        return series

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, series in list(self._series.items()):
            self._add(family, values, series)
        yield family

    @abstractmethod
    def _new(self) -> S: ...

    @abstractmethod
    def _family(self) -> F: ...

    @abstractmethod
    def _add(self, family: F, values: tuple[str, ...], series: S) -> None: ...


class FastCounter(_Family[Count, CounterMetricFamily]):
    def _new(self) -> Count:
        return Count()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: CounterMetricFamily, values: tuple[str, ...], series: Count) -> None:
        family.add_metric(values, series.value, created=series.created)


class FastHistogram(_Family[Observed, HistogramMetricFamily]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], *,
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"{name}: buckets must be increasing")
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> Observed:
        return Observed(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: HistogramMetricFamily, values: tuple[str, ...], series: Observed) -> None:
        total, buckets = 0, []
        for le, n in zip(self._le, series.counts, strict=True):
            total += n
            buckets.append((le, float(total)))
        family.add_metric(values, buckets, series.sum)
