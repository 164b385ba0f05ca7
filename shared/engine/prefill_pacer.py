"""Stall-free chunking: how many prompt tokens a step may take while it also carries decodes.

A prompt chunk computed in the same step as running decodes makes each of those decodes wait for it: on a
CPU core a 128-token chunk of a 135M model adds ~300 ms to a token that otherwise takes ~50. Given a target
(`prefill_beside_decodes_ms`), the pacer learns the seconds a prompt token costs from the steps it sees and
lets a step carrying decodes take about the target's worth of prompt tokens; a step with no decodes keeps
the whole budget (nobody is waiting). Its estimate, the step's time over its prompt tokens, counts the
decodes' share of a step too, so it errs towards smaller chunks; fed back, a mixed step settles near the
target.
"""

from __future__ import annotations

from dataclasses import dataclass

# Until a step has been measured, a step carrying decodes takes at most this many prompt tokens.
START_TOKENS = 64


@dataclass
class PrefillPacer:
    target_s: float
    floor_tokens: int = 16  # a chunk always makes this much progress, however slow a token
    start_tokens: int = START_TOKENS
    smoothing: float = 0.3  # weight of the newest step in the estimate
    seconds_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.target_s <= 0:
            raise ValueError("the prefill target beside decodes must be positive")

    def cap(self) -> int:
        """Prompt tokens a step carrying decodes may take now."""
        if self.seconds_per_token is None:
            return max(self.floor_tokens, self.start_tokens)
        return max(self.floor_tokens, int(self.target_s / self.seconds_per_token))

    def observe(self, step_s: float, prompt_tokens: int) -> None:
        """A finished step: its wall time and the prompt tokens it computed."""
        if prompt_tokens < self.floor_tokens:
            return  # a step of decodes and a token or two of prompt says little about a prompt token's cost
        sample = step_s / prompt_tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = sample
        else:
            self.seconds_per_token += self.smoothing * (sample - self.seconds_per_token)
