"""How busy a pipeline stage keeps: busy time, and the idle (bubble) fraction while there is work.

A pipeline's bubble is the time a stage waits for its input while the
pipeline as a whole has work. A stage sees only its own steps, so it counts as
bubble the gaps between steps shorter than `max_gap_s`; a longer gap means
there was no work (nobody was asking), which is not a bubble.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class Utilization:
    max_gap_s: float = 1.0
    busy_s: float = 0.0
    idle_s: float = 0.0
    steps: int = 0
    _last_end: float | None = None

    def record(self, start: float, end: float) -> None:
        """One step computed from `start` to `end` (seconds on one monotonic clock)."""
        if self._last_end is not None:
            gap = start - self._last_end
            if 0 < gap <= self.max_gap_s:
                self.idle_s += gap
        self.busy_s += max(0.0, end - start)
        self.steps += 1
        self._last_end = end

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0

    def snapshot(self) -> dict:
        return {"busy_seconds": round(self.busy_s, 6), "idle_seconds": round(self.idle_s, 6), "steps": self.steps,
                "idle_fraction": round(self.idle_fraction, 6)}
