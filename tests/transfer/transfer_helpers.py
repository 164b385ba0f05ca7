"""Helpers of the side-channel tests: KV-shaped tensors, an on_part sink, /dev/shm listings, a raw protocol client."""

import asyncio
import os
import secrets
import struct

import msgpack
import torch

from shared.transfer import TransferTicket
from shared.transfer.shm import SHM_DIR
from shared.transfer.wire import PROTOCOL_VERSION, sender_proof

# Small limits so that failure paths end fast.
RECEIVER_OPTIONS = dict(handshake_timeout_s=2.0, io_timeout_s=2.0)


def kv(layers: int, dtype=torch.float32, seed: int = 0, blocks: int = 3) -> torch.Tensor:
    """A KV-shaped tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` of distinct values."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, blocks, 4, 2, 8, generator=gen).to(dtype)


class Sink:
    """An `on_part` that copies each part into `dst` (as a decode worker copies into its cache) and logs it."""

    def __init__(self, like: torch.Tensor, layer_start: int = 0):
        self.dst = torch.zeros_like(like)
        self.layer_start = layer_start
        self.calls: list[tuple[int, int]] = []
        self.times: list[float] = []

    def __call__(self, start: int, end: int, tensor: torch.Tensor) -> None:
        assert tensor.shape[0] == end - start
        self.dst[start - self.layer_start : end - self.layer_start].copy_(tensor)
        self.calls.append((start, end))
        self.times.append(asyncio.get_running_loop().time())

    @property
    def layers(self) -> list[int]:
        return sorted(layer for start, end in self.calls for layer in range(start, end))


def segments_with_prefix(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def segments_of_pid(pid: int) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith("ssk-") and name.split("-")[2] == str(pid))


class RawClient:
    """Speaks the side-channel protocol by hand (to send what a correct sender never would)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: dict):
        self.reader = reader
        self.writer = writer
        self.hello = hello

    @classmethod
    async def connect(cls, ticket: TransferTicket) -> "RawClient":
        reader, writer = await asyncio.open_connection(ticket.endpoint.host, ticket.endpoint.port)
        client = cls(reader, writer, {})
        client.hello = await client.recv()
        return client

    def send(self, msg: dict, raw: bytes = b"") -> None:
        body = msgpack.packb(msg, use_bin_type=True)
        self.writer.write(struct.pack("!I", len(body)) + body + raw)

    async def recv(self) -> dict:
        (length,) = struct.unpack("!I", await asyncio.wait_for(self.reader.readexactly(4), 5))
        return msgpack.unpackb(await asyncio.wait_for(self.reader.readexactly(length), 5), raw=False)

    async def authenticate(self, ticket: TransferTicket, backend: str = "tcp", token: bytes | None = None) -> None:
        nonce = secrets.token_bytes(32)
        mac = sender_proof(token or ticket.token, ticket.transfer_id, self.hello["nonce"], nonce)
        self.send({"v": PROTOCOL_VERSION, "transfer_id": ticket.transfer_id, "nonce": nonce, "backend": backend,
                   "mac": mac})

    async def closed(self) -> bool:
        """True once the receiver closed the connection (reads what it said before)."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), 5):
                pass
        except (ConnectionError, TimeoutError):
            pass
        return True

    def close(self) -> None:
        self.writer.close()
