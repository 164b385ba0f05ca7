"""A flood of connections that never authenticate cannot starve real transfers (issue 13, item 5)."""

import asyncio
import json
import subprocess
import sys

import msgspec
import pytest
import torch

from shared.transfer import KVReceiver, KVSender
from transfer_helpers import Sink, kv

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


async def silent_connection(port: int):
    """Connects and never says a word (the receiver's hello is left unread)."""
    return await asyncio.open_connection("127.0.0.1", port)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_silent_connections_past_the_bound_make_room_and_the_real_sender_gets_through(backend):
    receiver = KVReceiver(max_handshakes=8, handshake_timeout_s=30.0)  # silence alone would hold a slot 30 s
    await receiver.start()
    sender = KVSender()
    flood = []
    try:
        port = receiver.endpoint.port
        flood = [await silent_connection(port) for _ in range(40)]
        src = kv(3, seed=2)
        sink = Sink(src)
        ticket = receiver.expect("through", on_part=sink, total_layers=(0, 3), deadline_s=10)
        result = await sender.send(ticket, [(0, 3, src)], backend=backend)
        assert result.ok, result
        assert (await receiver.wait("through")).ok and torch.equal(sink.dst, src)
        assert receiver.stats.evicted_handshakes >= 32  # the oldest silent ones made room, none was refused
        assert receiver.stats.refused_connections == 0
        assert receiver.stats.snapshot()["evicted_handshakes"] == receiver.stats.evicted_handshakes
    finally:
        for _, writer in flood:
            writer.close()
        sender.close()
        await receiver.stop()


class FlakyFront:
    """A TCP front for the receiver whose first connection is closed: at once, or after the sender's auth."""

    def __init__(self, receiver_port: int, close: str):
        self.receiver_port, self.close, self.connections = receiver_port, close, 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer):
        self.connections += 1
        if self.connections == 1 and self.close == "at-once":
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.receiver_port)
        if self.connections == 1:  # "after-auth": the hello goes through, the auth is swallowed, then closed
            hello_len = int.from_bytes(await up_reader.readexactly(4), "big")
            writer.write(hello_len.to_bytes(4, "big") + await up_reader.readexactly(hello_len))
            await writer.drain()
            auth_len = int.from_bytes(await reader.readexactly(4), "big")
            await reader.readexactly(auth_len)
            writer.close()
            up_writer.close()
            return

        async def pipe(src, dst):
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)


@pytest.mark.parametrize("close", ["at-once", "after-auth"])
async def test_a_connection_lost_before_the_receiver_took_anything_is_retried(close):
    receiver = KVReceiver()
    await receiver.start()
    sender = KVSender()
    try:
        front = FlakyFront(receiver.endpoint.port, close)
        port = await front.start()
        src = kv(4, seed=5)
        sink = Sink(src)
        ticket = receiver.expect("retried", on_part=sink, total_layers=(0, 4), deadline_s=10)
        ticket = msgspec.structs.replace(ticket, endpoint=msgspec.structs.replace(ticket.endpoint, port=port))

        async def parts():  # a producer: the part the lost connection had already taken must not be lost
            for layer in range(4):
                yield layer, layer + 1, src[layer:layer + 1]

        result = await sender.send(ticket, parts(), backend="tcp")
        assert result.ok, result
        assert (await receiver.wait("retried")).ok and torch.equal(sink.dst, src)
        assert front.connections == 2 and sender.stats.retried_connections == 1
    finally:
        sender.close()
        await receiver.stop()


async def test_a_receiver_that_is_not_there_still_fails_fast():
    receiver = KVReceiver()
    await receiver.start()
    ticket = receiver.expect("nobody", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=30)
    await receiver.stop()  # the port is closed: connections are refused
    sender = KVSender()
    try:
        started = asyncio.get_running_loop().time()
        result = await sender.send(ticket, [(0, 1, kv(1))], backend="tcp")
        assert not result.ok and result.reason == "connection"
        # The time is the claim: a few quick retries, not the 30 s deadline (loose for a loaded machine).
        assert asyncio.get_running_loop().time() - started < 10
    finally:
        sender.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_three_hundred_flooders_and_every_transfer_meets_its_deadline(tmp_path, tls):
    """With TLS every flood connection also completes a handshake (the receiver's key exchange and signature)."""
    out = tmp_path / "flood.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.bench_side_channel_flood", "--flooders", "300", "--transfers", "8",
        "--size", str(1 << 20), "--deadline", "10", "--output", str(out), *(["--tls"] if tls else []),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, stderr = await asyncio.wait_for(proc.communicate(), 110)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    phases = {p["phase"]: p for p in json.loads(out.read_text())["phases"]}
    assert phases["flood"]["met_deadline"] == 8 and phases["quiet"]["met_deadline"] == 8
    assert phases["flood"]["flood_connections_opened"] >= 300  # the flood was really there
    assert json.loads(out.read_text())["settings"]["tls"] is tls
    assert phases["flood"]["receiver"]["unauthenticated"] + phases["flood"]["receiver"]["evicted_handshakes"] > 0
