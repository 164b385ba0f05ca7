"""Authentication: a wrong token or an unknown transfer is turned away without harming the real transfer."""

import asyncio
import secrets
import struct
import time

import msgpack
import msgspec
import pytest
import torch

from contracts import TransferEndpoint
from shared.transfer import KVSender, TransferTicket
from shared.transfer.wire import PROTOCOL_VERSION
from support.waiting import eventually
from transfer_helpers import RawClient, Sink, kv

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_wrong_token_is_rejected_and_the_right_sender_still_succeeds(receiver, sender, backend):
    src = kv(3, seed=1)
    sink = Sink(src)
    ticket = receiver.expect("auth", on_part=sink, total_layers=(0, 3), deadline_s=10)
    forged = msgspec.structs.replace(ticket, token=secrets.token_bytes(32))

    impostor = await sender.send(forged, [(0, 3, torch.zeros_like(src))], backend=backend)

    assert not impostor.ok and impostor.reason == "rejected", impostor
    assert receiver.stats.unauthenticated == 1
    assert receiver.num_active == 1 and sink.calls == []  # the expectation is untouched

    real = await sender.send(ticket, [(0, 3, src)], backend=backend)
    assert real.ok, real
    assert (await receiver.wait("auth")).ok
    assert torch.equal(sink.dst, src)


async def test_an_unknown_transfer_is_rejected(receiver, sender):
    ticket = receiver.expect("known", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=10)
    unknown = msgspec.structs.replace(ticket, transfer_id="never-expected")
    result = await sender.send(unknown, [(0, 1, kv(1))], backend="tcp")
    assert not result.ok and result.reason == "rejected"
    assert receiver.stats.unauthenticated == 1 and receiver.num_active == 1


async def test_garbage_and_silence_are_turned_away_without_failing_anything(receiver):
    ticket = receiver.expect("quiet", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=10)
    reader, writer = await asyncio.open_connection(ticket.endpoint.host, ticket.endpoint.port)
    writer.write(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) is not None  # the receiver closes: read() ends
    writer.close()

    silent = await RawClient.connect(ticket)  # connects, never authenticates: closed after the handshake timeout
    start = asyncio.get_running_loop().time()
    await silent.closed()
    # The time is the claim: closed at the 2 s handshake timeout (`closed()` gives up waiting at 5 s).
    assert asyncio.get_running_loop().time() - start < receiver.handshake_timeout_s + 2.0
    silent.close()

    replayed = await RawClient.connect(ticket)  # a well-formed hello with a MAC for another nonce
    replayed.send({"v": PROTOCOL_VERSION, "transfer_id": "quiet", "nonce": secrets.token_bytes(32),
                   "backend": "tcp", "mac": secrets.token_bytes(32)})
    assert (await replayed.recv())["status"] == "rejected"
    await replayed.closed()
    replayed.close()

    assert receiver.stats.unauthenticated == 3
    assert receiver.num_active == 1


async def test_a_receiver_that_cannot_prove_the_token_gets_no_data(sender):
    """An impostor listening where the ticket points: the sender checks its MAC before sending any part."""
    got = bytearray()

    async def impostor(reader, writer):
        body = msgpack.packb({"v": PROTOCOL_VERSION, "nonce": secrets.token_bytes(32), "host_id": "x"})
        writer.write(struct.pack("!I", len(body)) + body)
        (n,) = struct.unpack("!I", await reader.readexactly(4))
        await reader.readexactly(n)  # the sender's auth
        body = msgpack.packb({"status": "ready", "mac": secrets.token_bytes(32), "max_part_bytes": 1 << 30})
        writer.write(struct.pack("!I", len(body)) + body)
        got.extend(await reader.read())
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ticket = TransferTicket(transfer_id="t", token=secrets.token_bytes(32), deadline_unix_s=time.time() + 10,
                            endpoint=TransferEndpoint(host="127.0.0.1", port=port, host_id="x"))
    result = await sender.send(ticket, [(0, 2, kv(2))], backend="tcp")
    server.close()
    assert not result.ok and result.reason == "receiver-unauthenticated", result
    assert len(got) == 0  # not one part header, let alone KV bytes


async def test_a_second_authenticated_sender_takes_over_the_transfer(receiver):
    src = kv(4, seed=9)
    sink = Sink(src)
    ticket = receiver.expect("takeover", on_part=sink, total_layers=(0, 4), deadline_s=10)
    release = asyncio.Event()

    async def stuck_after_one_layer():
        yield 0, 1, src[0:1]
        await release.wait()
        yield 1, 4, src[1:4]

    first, second = KVSender(), KVSender()
    try:
        stuck = asyncio.create_task(first.send(ticket, stuck_after_one_layer(), backend="tcp"))
        await eventually(lambda: sink.calls, what="the first sender's first layer applied")
        fresh = await second.send(ticket, [(0, 4, src)], backend="tcp")
        assert fresh.ok, fresh
        assert (await receiver.wait("takeover")).ok
        release.set()
        late = await stuck
        assert not late.ok  # its connection was closed under it
        assert torch.equal(sink.dst, src)
    finally:
        first.close()
        second.close()
