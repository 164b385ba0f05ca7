"""Per-request sampling parameters: one msgspec struct that the engine takes and the wire carries.

It lives here, beside the engine's rules for it, and `contracts` carries it as a part of its messages (as vLLM's
`EngineCoreRequest` carries its `SamplingParams`). This module imports only msgspec and the engine's errors, so
`contracts` stays light (no torch), and the engine never imports `contracts` (no import cycle). It is configured as
`contracts.codec.Part` is (keyword-only, unknown fields refused) without subclassing it, for that same reason.

Decoding checks only the fields' types; `validate()` checks their values. It runs where a request enters (the
gateway, `splitserve generate`, the engine's `add_request`) and where a worker takes one off the bus.
"""

import msgspec
from msgspec import field

from shared.engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
LOGIT_BIAS_RANGE = 100.0  # each bias is within [-100, 100], as OpenAI's
MAX_TENANT_CHARS = 128
MAX_PRIORITY = 2**31 - 1


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one request turns logits into tokens and when it stops.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 switch
    those filters off. presence/frequency penalties follow OpenAI (over the
    generated tokens); repetition_penalty follows transformers (over prompt and
    generated tokens). logprobs=None returns none; logprobs=N returns the
    sampled token's logprob and the top N (of the model's own distribution).
    logit_bias adds to a token's logit before anything else; min_tokens keeps
    EOS and stop_token_ids from being drawn, and stop strings from matching,
    until that many tokens are out.
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
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: the constraint's kind ("" none; "json", "json_object", "regex", "choice", "grammar") and
    # its spec (a JSON schema, a regex, a JSON list of strings, a Lark or GBNF grammar); shared/engine/structured_output.py
    structured_kind: str = ""
    structured_spec: str = ""
    # The prompt's tokens' logprobs (and this many top alternatives at each position); the prompt is then computed
    # whole, not read from a prefix cache.
    prompt_logprobs: int | None = None
    # Prefix reuse only among requests with the same salt (shared/engine/block_hash.py): the gateway's, per tenant.
    cache_salt: str = ""
    # Who the request is for and how urgent: the gateway's, from its API key (not a client's field). An engine
    # shares its batch between tenants by these (shared/engine/batch_share.py).
    tenant: str = ""
    priority: int = 0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field whose value is out of range. A lone stop string
        becomes a list of one, and the lists and the dict are copied (the caller's stay theirs)."""
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
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
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                                      f"{self.prompt_logprobs!r}", "prompt_logprobs")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                                      "min_tokens")
        if self.structured_kind and self.structured_kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.structured_kind!r}; one of "
                                      f"{', '.join(STRUCTURED_KINDS)}", "structured_outputs")
        if self.structured_spec and not self.structured_kind:
            raise InvalidRequestError("a structured output spec needs its kind", "structured_outputs")
        if not isinstance(self.cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {self.cache_salt!r}", "cache_salt")
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_CHARS:
            raise InvalidRequestError(f"tenant must be a string of at most {MAX_TENANT_CHARS} characters", "tenant")
        if not isinstance(self.priority, int) or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidRequestError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got "
                                      f"{self.priority!r}", "priority")
        self.logit_bias = dict(self.logit_bias)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                                      "logit_bias")
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token_id!r}", "logit_bias")
            if not isinstance(bias, (int, float)) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r}", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_token_ids(self, vocab_size: int) -> None:
        """Reject stop token ids and logit_bias keys the model cannot produce."""
        for param, token_ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            for token_id in token_ids:
                if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                    raise InvalidRequestError(
                        f"token id {token_id!r} in {param} is outside the vocabulary [0, {vocab_size})", param
                    )

    def suppressed_token_ids(self, num_output_tokens: int, eos_token_ids) -> tuple[int, ...]:
        """The tokens not to be drawn as output token number `num_output_tokens` (0-based): EOS (unless ignored)
        and the stop token ids while fewer than min_tokens are out."""
        if num_output_tokens >= self.min_tokens:
            return ()
        return tuple(sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))))
