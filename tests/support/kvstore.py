"""A real kv-store process for tests, and a worker's client of it: small blocks, hashes, readiness."""

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

import nats
import torch

from contracts import Sender, ServiceInfo, ServiceStats, StatsRequest, Subjects
from services.kvstore.client import KVStoreClient
from shared.bus.registry import Heartbeat, Registry
from shared.transfer import KVReceiver, KVSender
from support.processes import start_service

BLOCK_SHAPE = (4, 2, 16, 2, 8)  # layers, K/V, block size, kv heads, head dim (float32: 8 KiB)
BLOCK_BYTES = 4 * 2 * 16 * 2 * 8 * 4


def blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, *BLOCK_SHAPE, generator=torch.Generator().manual_seed(seed))


def hashes(n: int, prefix: int) -> list[bytes]:
    return [bytes([prefix]) + i.to_bytes(15, "big") for i in range(n)]


def start_kvstore(nats_url: str, namespace: str, tmp_path, instance: str = "kvstore-0", ram_blocks: int = 4,
                  disk_blocks: int = 8, **env):
    args = ["--nats", nats_url, "--namespace", namespace, "--instance-id", instance,
            "--kv-store-ram-bytes", str(ram_blocks * BLOCK_BYTES),
            "--kv-store-disk-bytes", str(disk_blocks * (BLOCK_BYTES + 256)), "--kv-store-dir", str(tmp_path / "disk")]
    return start_service("kvstore", args, tmp_path, **env)


async def wait_ready(nc, subjects: Subjects, instance: str, timeout_s: float = 60) -> ServiceStats:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = await nc.request(subjects.stats(instance), StatsRequest().encode(), timeout=1)
            info = ServiceStats.decode(reply.data)
            if info.state == "ready":
                return info
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            pass
        assert time.monotonic() < deadline, f"{instance} not ready"
        await asyncio.sleep(0.2)


async def stored(nc, subjects: Subjects, puts: int, kept: int = 0) -> ServiceStats:
    """The store's stats once it has stored `puts` blocks and refused `kept` over blocks it held (a put is acked
    once its transfer is in, stored after)."""
    deadline = time.monotonic() + 10
    while True:
        info = await wait_ready(nc, subjects, "kvstore-0")
        store = info.details["store"]
        if store["puts"] + store.get("kept_first", 0) >= puts + kept:
            return info
        assert time.monotonic() < deadline, info.details
        await asyncio.sleep(0.05)


class Collect:
    def __init__(self, n: int):
        self.out = torch.zeros(n, *BLOCK_SHAPE)

    def __call__(self, first: int, end: int, tensor) -> None:
        self.out[first:end].copy_(tensor)


WORKER = Sender("decode", "test-worker")  # the client's name: registered as a worker of its model, as stores require


@asynccontextmanager
async def kvstore_client(nats_url: str, model_fingerprint: bytes = b"model-a"):
    """(a worker's client, its NATS connection, a fresh namespace's subjects); the worker is registered (and kept
    so by a heartbeat) as a decode worker of `model_fingerprint`, the model a store then serves it."""
    nc = await nats.connect(nats_url)
    receiver, sender = KVReceiver(), KVSender()
    await receiver.start()
    subjects = Subjects("t" + uuid.uuid4().hex[:10])
    registry = await Registry.open(nc.jetstream(), subjects.registry_bucket)
    heartbeat = Heartbeat(registry, lambda: ServiceInfo(instance_id=WORKER.instance_id, role=WORKER.role,
                                                        state="ready", kv_fingerprint=model_fingerprint))
    heartbeat.start()
    try:
        yield (KVStoreClient(nc=nc, subjects=subjects, receiver=receiver, sender=sender,
                             model_fingerprint=model_fingerprint, me=WORKER, timeout_s=5), nc, subjects)
    finally:
        await heartbeat.stop()
        await receiver.stop()
        sender.close()
        await nc.close()
