"""Per-request sampling parameters, validated where they are made."""

from dataclasses import dataclass, field

from shared.engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 switch
    those filters off. presence/frequency penalties follow OpenAI (over the
    generated tokens); repetition_penalty follows transformers (over prompt and
    generated tokens). logprobs=None returns none; logprobs=N returns the
    sampled token's logprob and the top N.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not 0.0 <= self.temperature:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int):
            raise InvalidRequestError(f"top_k must be an integer, got {self.top_k!r}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}", "logprobs"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_token_ids(self, vocab_size: int) -> None:
        """Reject stop token ids the model cannot produce."""
        for token_id in self.stop_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"stop token id {token_id!r} is outside the vocabulary [0, {vocab_size})", "stop_token_ids"
                )
