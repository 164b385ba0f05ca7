"""The engine's defaults, in one place: EngineConfig, the step scheduler, the services' flags and a pipeline stage
take theirs from here."""

DEFAULT_DTYPE = "auto"  # auto | float32 | bfloat16 | float16
DEFAULT_DEVICE = "cpu"  # cpu | cuda | cuda:N
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block
DEFAULT_KV_CACHE_BYTES = 512 << 20
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
SCHEDULING_POLICIES = ("fair", "fcfs")  # the batch shared between tenants by priority and places held; or arrival
DEFAULT_SCHEDULING_POLICY = "fair"
DEFAULT_MICROBATCHES = 2  # a pipeline's steps in flight at once
DEFAULT_STEP_TIMEOUT_S = 60.0  # a pipeline step's time through every stage before its requests fail
