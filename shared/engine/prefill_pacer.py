"""Stall-free chunking: how many prompt tokens a step may take while it also carries decodes.

A prompt chunk computed in the same step as running decodes makes each of those decodes wait for it: on a
CPU core a 128-token chunk of a 135M model adds ~300 ms to a token that otherwise takes ~50. Given a target
(`prefill_beside_decodes_ms`) for such a step, the pacer lets it take the prompt tokens that fit beside its
decodes: (target - a step of decodes alone) over a prompt token's cost, both learnt from the steps it sees:

- a step of decodes alone measures the decodes' part of a step;
- a step with prompt tokens measures a token's cost, once the decodes' part (when it carried decodes) is
  taken off.

Both are learnt per OpenMP team size: a decode worker that borrows an idle CPU (`services.common.cpu_loan`)
runs its steps on one thread or two, and a cost learnt on two would let a step on one take twice the target.
A step with no decodes keeps the whole budget (nobody is waiting).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Until a token's cost is known, a step carrying decodes takes at most this many prompt tokens.
START_TOKENS = 64
# A step's prompt part is taken as at least this fraction of the step (timing noise must not make it free).
_MIN_PROMPT_SHARE = 0.25


@dataclass
class StepCosts:
    """What one team size's steps cost, smoothed: a step of decodes alone, and a prompt token in a step."""
    decodes_s: float | None = None
    token_s: float | None = None


def _smoothed(old: float | None, sample: float, weight: float) -> float:
    return sample if old is None else old + weight * (sample - old)


@dataclass
class PrefillPacer:
    target_s: float
    floor_tokens: int = 16  # a chunk always makes this much progress, however slow a token
    start_tokens: int = START_TOKENS
    smoothing: float = 0.3  # weight of the newest step in the estimates
    costs: dict[int, StepCosts] = field(default_factory=dict)  # by OpenMP team size

    def __post_init__(self) -> None:
        if self.target_s <= 0:
            raise ValueError("the prefill target beside decodes must be positive")

    def cap(self, threads: int = 1) -> int:
        """Prompt tokens a step carrying decodes, on `threads` threads, may take now."""
        costs = self.costs.get(threads)
        if costs is None or costs.token_s is None:
            return max(self.floor_tokens, self.start_tokens)
        room = self.target_s - (costs.decodes_s or 0.0)
        return max(self.floor_tokens, int(room / costs.token_s))

    def observe(self, step_s: float, prompt_tokens: int, decodes: int, threads: int = 1) -> None:
        """A finished step: its wall time, the prompt tokens and the decodes it computed, its team size."""
        costs = self.costs.setdefault(threads, StepCosts())
        if prompt_tokens == 0:
            if decodes:
                costs.decodes_s = _smoothed(costs.decodes_s, step_s, self.smoothing)
            return
        if prompt_tokens < self.floor_tokens:
            return  # a step of decodes and a token or two of prompt says little about either cost
        # Unknown decodes' part: the whole step is the prompt's, which errs towards smaller chunks.
        decodes_part = (costs.decodes_s or 0.0) if decodes else 0.0
        prompt_s = max(step_s - decodes_part, _MIN_PROMPT_SHARE * step_s)
        costs.token_s = _smoothed(costs.token_s, prompt_s / prompt_tokens, self.smoothing)
