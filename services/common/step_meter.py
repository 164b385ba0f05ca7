"""What a worker's engine steps cost: cumulative counts per kind of step, for the SLO planner and /metrics.

A step is a "prompt" step when it computed prompt tokens (a prefill chunk, alone or beside decodes), else a
"decode" step. From two readings a window apart a planner derives a decode step-time fit (mean ms per step
against mean sequences per step, over decode steps) and a prefill capacity (prompt tokens per busy second, over
prompt steps). Written by the engine thread only (integer and float adds); read from any thread.
"""

from __future__ import annotations

KINDS = ("decode", "prompt")


class StepCounts:
    __slots__ = ("steps", "seconds", "sequences", "prompt_tokens")

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.sequences = 0  # sequences that got a token in the step
        self.prompt_tokens = 0  # prompt tokens computed in the step

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seconds": self.seconds, "sequences": self.sequences,
                "prompt_tokens": self.prompt_tokens}


class StepMeter:
    def __init__(self) -> None:
        self.decode = StepCounts()
        self.prompt = StepCounts()

    def record(self, seconds: float, sequences: int, prompt_tokens: int) -> None:
        counts = self.prompt if prompt_tokens else self.decode
        counts.steps += 1
        counts.seconds += seconds
        counts.sequences += sequences
        counts.prompt_tokens += prompt_tokens

    def details(self) -> dict:
        """{"decode": {...}, "prompt": {...}}: every count so far."""
        return {kind: getattr(self, kind).as_dict() for kind in KINDS}
