"""`Continuation`: a request that starts part-way, with tokens or KV computed before it reached this engine.

A decode worker continues a request a prefill worker started (its first token, and the prompt's KV written
into reserved blocks); a request whose transfer failed continues after the first token it already streamed.
The engine checks that the KV fits the request when it is added. (A prefix loaded from the kv-store is not a
continuation: a connector loads it when the engine admits the request, see `kv_connector`.)
"""

import enum
from dataclasses import dataclass, field

import torch

from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.kv_cache import KVLayout


class KVOrigin(enum.Enum):
    COMPUTED = "computed"  # computed elsewhere; the kv-store does not have its blocks
    WRITTEN_BACK = "written_back"  # computed elsewhere, whose full blocks went to the kv-store there


@dataclass(slots=True, frozen=True)
class ReservedKV:
    """Blocks from `reserve_blocks` already written with the KV of the request's first `num_tokens` tokens."""

    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True, frozen=True)
class Continuation:
    """Where a request starts: `output_token_ids` generated already, and the KV of its first tokens, either
    as imported tensors (`kv`: every layer of this engine, possibly in several layer parts) or in `reserved`
    blocks (never both). `num_cached_tokens` of that KV were a prefix-cache hit where it was computed.
    `detokenizer` continues the text already streamed for `output_token_ids` (else a new one starts after
    them)."""

    output_token_ids: list[int] = field(default_factory=list)
    kv: list[tuple[torch.Tensor, KVLayout]] = field(default_factory=list)
    reserved: ReservedKV | None = None
    num_cached_tokens: int = 0
    kv_origin: KVOrigin = KVOrigin.COMPUTED
    detokenizer: IncrementalDetokenizer | None = None

    def __post_init__(self) -> None:
        if self.kv and self.reserved is not None:
            raise ValueError("a continuation brings its KV as tensors or in reserved blocks, not both")

    @property
    def has_kv(self) -> bool:
        return bool(self.kv) or self.reserved is not None
