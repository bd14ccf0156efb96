"""A mergeable log-scale histogram of signed latencies (seconds).

Spark partitions each fill one and the driver adds them up, so the
distribution costs a fixed 361 counters however many versions are matched.
Buckets are 20 per decade from 1 microsecond to 1000 seconds on each side of
zero (about 12% wide), plus one bucket for anything within a microsecond of
zero; quantiles are read at a bucket's geometric middle.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PER_DECADE = 20
MIN_EXP = -6
MAX_EXP = 3
SPAN = (MAX_EXP - MIN_EXP) * PER_DECADE
ZERO = SPAN
SIZE = 2 * SPAN + 1
_LOG_MIN = MIN_EXP * PER_DECADE


def bucket(x: float) -> int:
    magnitude = abs(x)
    if magnitude < 10.0**MIN_EXP:
        return ZERO
    step = min(SPAN - 1, int(math.log10(magnitude) * PER_DECADE - _LOG_MIN))
    return ZERO + 1 + step if x > 0 else ZERO - 1 - step


def bucket_value(index: int) -> float:
    if index == ZERO:
        return 0.0
    step = abs(index - ZERO) - 1
    value: float = 10.0 ** ((step + 0.5 + _LOG_MIN) / PER_DECADE)
    return value if index > ZERO else -value


def bucket_bounds(index: int) -> tuple[float, float]:
    """The range of values ``bucket`` puts in ``index`` (low, high), signed."""
    if index == ZERO:
        return -(10.0**MIN_EXP), 10.0**MIN_EXP
    step = abs(index - ZERO) - 1
    low = 10.0 ** ((step + _LOG_MIN) / PER_DECADE)
    high = 10.0 ** ((step + 1 + _LOG_MIN) / PER_DECADE)
    return (low, high) if index > ZERO else (-high, -low)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * SIZE)
    count: int = 0
    total: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add_all(self, values: Iterable[float]) -> None:
        counts = self.counts
        for x in values:
            counts[bucket(x)] += 1
            self.count += 1
            self.total += x
            self.low = min(self.low, x)
            self.high = max(self.high, x)

    def merge(
        self, counts: Sequence[int], count: int, total: float, low: float, high: float
    ) -> None:
        if not count:
            return
        for i, n in enumerate(counts):
            self.counts[i] += n
        self.count += count
        self.total += total
        self.low = min(self.low, low)
        self.high = max(self.high, high)

    def quantile(self, q: float) -> float | None:
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen > rank:
                return min(self.high, max(self.low, bucket_value(i)))
        return self.high

    def buckets(self) -> list[tuple[float, float, int]]:
        """The non-empty buckets, lowest first: (low, high, count)."""
        return [(*bucket_bounds(i), n) for i, n in enumerate(self.counts) if n]

    def summary(self) -> dict[str, float | int | None]:
        if not self.count:
            return {"count": 0}
        return {
            "count": self.count,
            "mean_s": self.total / self.count,
            "min_s": self.low,
            "p50_s": self.quantile(0.5),
            "p90_s": self.quantile(0.9),
            "p99_s": self.quantile(0.99),
            "p999_s": self.quantile(0.999),
            "max_s": self.high,
        }
