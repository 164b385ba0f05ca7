"""The engine's defaults, in one place: EngineConfig, the step scheduler, the services' flags and a pipeline stage
take theirs from here."""

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block
DEFAULT_KV_CACHE_BYTES = 512 << 20
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
