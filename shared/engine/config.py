"""Engine settings, validated where they are made."""

from dataclasses import dataclass

from shared.engine.defaults import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SCHEDULING_POLICY,
    SCHEDULING_POLICIES,
)
from shared.engine.model_loader import LayerRange


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    gpu_memory_utilization: float | None = None  # on a GPU: size the KV cache from this share of its memory instead
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY  # one of SCHEDULING_POLICIES (shared/engine/batch_share.py)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_waiting_requests: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # A step carrying decodes takes about this many ms of prompt chunks (None: its whole token budget).
    prefill_beside_decodes_ms: float | None = None
    layer_ranges: list[LayerRange] | None = None  # run the model as a chain of ranges (pipeline layout)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be positive")
        if self.prefill_beside_decodes_ms is not None and self.prefill_beside_decodes_ms <= 0:
            raise ValueError("prefill_beside_decodes_ms must be positive")
