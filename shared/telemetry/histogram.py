"""A cumulative histogram small enough to travel in a registry entry."""

import bisect
import math


class CumulativeHistogram:
    """Prometheus-style buckets (`le` upper bounds, cumulative counts) plus the sum of observations."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(sorted(bounds)) + (math.inf,)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        cumulative, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            cumulative.append(["+Inf" if math.isinf(bound) else bound, running])
        return {"buckets": cumulative, "sum": self.sum}
