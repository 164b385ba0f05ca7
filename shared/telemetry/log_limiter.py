"""Say a repeated complaint once per source and interval, counting the repeats kept quiet in between.

A peer that sends the same bad message thousands of times a second must not
grow the logs as fast: `LogLimiter.allow(source)` lets a line through at most
once per `interval_s` for each source (remembering at most `max_sources`
sources), and says how many it kept quiet since the last one.
"""

import time
from collections import OrderedDict


class LogLimiter:
    def __init__(self, interval_s: float = 60.0, max_sources: int = 1024):
        self.interval_s = interval_s
        self.max_sources = max_sources
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # source -> (last said, kept quiet since)

    def allow(self, source: str, now: float | None = None) -> int | None:
        """None: keep quiet; else say it, with this many repeats kept quiet since the last time."""
        now = time.monotonic() if now is None else now
        last = self._last.get(source)
        if last is not None and now - last[0] < self.interval_s:
            self._last[source] = (last[0], last[1] + 1)
            return None
        self._last[source] = (now, 0)
        self._last.move_to_end(source)
        while len(self._last) > self.max_sources:  # bounded: the oldest source is forgotten (and may be said again)
            self._last.popitem(last=False)
        return 0 if last is None else last[1]
