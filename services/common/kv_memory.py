"""Where a worker's paged KV cache lives when its KV leaves the process over the side channel."""

import torch

from shared.telemetry.logging import get_logger
from shared.transfer import shm_available, sweep_orphan_segments
from shared.transfer.shm import shared_zeros

log = get_logger(__name__)


def kv_cache_allocator(kv_transport: str, device: str):
    """A KV allocator for a cache whose KV ships out (a prefill worker's, a prefill stage's): a shared-memory
    region when it may leave over shm, so that a receiver on this host copies the blocks straight out of it;
    else (None) private memory."""
    if kv_transport == "tcp" or torch.device(device).type != "cpu" or not shm_available():
        return None

    def allocate(shape, dtype, device):
        sweep_orphan_segments()  # a killed predecessor's cache would otherwise still hold the memory
        try:
            return shared_zeros(shape, dtype, device)
        except OSError as exc:
            log.warning("no room in /dev/shm for the KV cache: it stays private, and shm transfers copy it twice",
                        error=str(exc))
            return torch.zeros(shape, dtype=dtype, device=device)

    return allocate
