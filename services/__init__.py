"""splitserve's services. Everything here runs as (or starts) a service process."""

import os

# Large torch buffers (weights, packed weights, the paged KV cache) on 2 MiB pages: a decode step reads all of
# them, and with 4 KiB pages it spends part of that on TLB misses (measured on SmolLM2 at 2 threads: bf16 step
# 34.0 -> 31.8 ms at batch 16, 24.7 -> 23.2 ms at batch 1). torch reads this before its first allocation, so it
# is set here, before any service imports torch; an operator's own value wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# What a service process writes (logs, deployment.json, kv-store block files, NATS's store, shared memory) is
# its user's alone: files 0600, directories 0700.
os.umask(0o077)
