"""`Continuation`: how a request goes on from tokens computed before it reached this engine.

A decode worker's remote prefill ends its load with one (the first token the prefill worker sampled and
streamed, and how much of its prompt was cached there); a request moved from another worker would be added
with one (the tokens already streamed, computed again here). The KV itself always arrives through a
connector's load (see `kv_connector`).
"""

import enum
from dataclasses import dataclass, field

from shared.engine.detokenizer import IncrementalDetokenizer


class KVOrigin(enum.Enum):
    COMPUTED = "computed"  # computed elsewhere; the kv-store does not have its blocks
    WRITTEN_BACK = "written_back"  # computed elsewhere, whose full blocks went to the kv-store there


@dataclass(slots=True, frozen=True)
class Continuation:
    """`output_token_ids` generated already; `num_cached_tokens` of the prompt were a prefix-cache hit where
    its KV was computed, which came from `kv_origin`. `detokenizer` continues the text already streamed for
    `output_token_ids` (else one is replayed over them, in the state their streaming left it)."""

    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    kv_origin: KVOrigin = KVOrigin.COMPUTED
    detokenizer: IncrementalDetokenizer | None = None


@dataclass(slots=True, frozen=True)
class FirstToken:
    """A first token sampled elsewhere, judged here before its KV arrives (`LLMEngine.remote_first_token`): the
    `text` it releases, whether it ends the request (`finish_reason`), and the `continuation` that carries it
    (and the detokenizer it advanced) into the request's `LoadEnd`."""

    text: str
    finish_reason: str | None
    continuation: Continuation
