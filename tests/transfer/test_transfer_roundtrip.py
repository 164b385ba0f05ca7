"""Round trips over tcp and shm: dtypes, several parts in any order, streamed parts, reuse, ticket encoding."""

import asyncio

import msgpack
import msgspec
import pytest
import torch

from shared.transfer import KVSender, TransferTicket, host_id
from support.waiting import eventually
from transfer_helpers import Sink, kv, segments_with_prefix

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_parts_in_any_order_arrive_intact(receiver, sender, backend, dtype):
    src = kv(8, dtype, seed=1)
    sink = Sink(src, layer_start=4)
    ticket = receiver.expect("t1", on_part=sink, total_layers=(4, 12), deadline_s=10)
    parts = [(8, 12, src[4:8]), (4, 6, src[0:2]), (6, 8, src[2:4])]

    sent, got = await asyncio.gather(sender.send(ticket, parts, backend=backend), receiver.wait("t1"))

    assert sent.ok and got.ok, (sent, got)
    assert sent.backend == got.backend == backend
    nbytes = src.numel() * src.element_size()
    assert sent.num_bytes == got.num_bytes == nbytes
    assert torch.equal(sink.dst, src)  # bit-exact, bfloat16 included
    assert sink.calls == [(8, 12), (4, 6), (6, 8)]  # applied in the order sent
    assert receiver.stats.ok_by_backend[backend] == 1 and receiver.stats.bytes_by_backend[backend] == nbytes
    assert sender.stats.ok_by_backend[backend] == 1 and sender.stats.bytes_by_backend[backend] == nbytes


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_layers_stream_while_later_ones_are_still_computed(receiver, sender, backend):
    src = kv(4, torch.bfloat16, seed=2)
    sink = Sink(src)
    ticket = receiver.expect("stream", on_part=sink, total_layers=(0, 4), deadline_s=10)
    produced_last_at = []

    async def layer_by_layer():
        for layer in range(3):
            yield layer, layer + 1, src[layer : layer + 1]
        # The model is still computing the last layer: it comes only once the first three were applied (a sender
        # holding parts back until the end fails here).
        await eventually(lambda: len(sink.calls) == 3, what="the first three layers applied before the last existed")
        produced_last_at.append(asyncio.get_running_loop().time())
        yield 3, 4, src[3:4]

    sent, got = await asyncio.gather(sender.send(ticket, layer_by_layer(), backend=backend), receiver.wait("stream"))

    assert sent.ok and got.ok, (sent, got)
    assert torch.equal(sink.dst, src)
    # The first three layers were applied before the last one even existed.
    assert len(sink.times) == 4 and max(sink.times[:3]) < produced_last_at[0] <= sink.times[3]


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_big_part_is_split_by_layers_and_pipelined(receiver, backend):
    layer_bytes = 2 * 6 * 4 * 2 * 8 * 4  # one layer of kv(blocks=6), float32
    sender = KVSender(split_bytes=2 * layer_bytes, max_inflight_bytes=4 * layer_bytes)
    try:
        src = kv(9, seed=3, blocks=6)
        sink = Sink(src)
        ticket = receiver.expect("split", on_part=sink, total_layers=(0, 9), deadline_s=10)
        sent, got = await asyncio.gather(sender.send(ticket, [(0, 9, src)], backend=backend), receiver.wait("split"))
        assert sent.ok and got.ok, (sent, got)
        assert torch.equal(sink.dst, src)
        assert sink.calls == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9)]
        if backend == "shm":  # pieces in flight are bounded, so few segments were ever needed
            assert len(sender.shm_pool.names()) <= 3
    finally:
        sender.close()


async def test_auto_takes_shm_on_one_host_and_tcp_across_hosts(receiver, sender):
    src = kv(2)
    assert receiver.endpoint.host_id == host_id()
    local = receiver.expect("local", on_part=Sink(src), total_layers=(0, 2), deadline_s=10)
    remote = receiver.expect("remote", on_part=Sink(src), total_layers=(0, 2), deadline_s=10)
    remote = msgspec.structs.replace(
        remote, endpoint=msgspec.structs.replace(remote.endpoint, host_id="boot:another-machine/shm:1.2"))

    assert (await sender.send(local, [(0, 2, src)])).backend == "shm"
    assert (await sender.send(remote, [(0, 2, src)])).backend == "tcp"
    assert (await receiver.wait("local")).backend == "shm"
    assert (await receiver.wait("remote")).backend == "tcp"


async def test_one_connection_carries_consecutive_transfers(receiver, sender):
    src = kv(2)
    for i in range(3):
        ticket = receiver.expect(f"seq-{i}", on_part=Sink(src), total_layers=(0, 2), deadline_s=10)
        assert (await sender.send(ticket, [(0, 2, src)], backend="tcp")).ok
        assert (await receiver.wait(f"seq-{i}")).ok
    assert receiver.stats.connections == 1 and sender.stats.connections == 1


async def test_a_repeated_send_of_a_delivered_transfer_is_ok_without_resending(receiver, sender):
    src = kv(2)
    sink = Sink(src)
    ticket = receiver.expect("again", on_part=sink, total_layers=(0, 2), deadline_s=10)
    assert (await sender.send(ticket, [(0, 2, src)], backend="tcp")).ok
    second = KVSender()  # e.g. the prefill job redelivered to another worker
    try:
        again = await second.send(ticket, [(0, 2, src)], backend="tcp")
    finally:
        second.close()
    assert again.ok and again.num_bytes == 0
    assert len(sink.calls) == 1


async def test_non_contiguous_views_are_sent_by_value(receiver, sender):
    # Non-contiguous views (a transposed tensor, a strided slice) are sent by value.
    base = kv(4, seed=5)
    view = base.transpose(1, 2).contiguous().transpose(1, 2)[:, :, ::1]
    strided = kv(8, seed=6)[::2]
    for i, (backend, tensor) in enumerate([("tcp", view), ("shm", view), ("tcp", strided), ("shm", strided)]):
        sink = Sink(tensor)
        ticket = receiver.expect(f"views-{i}", on_part=sink, total_layers=(0, 4), deadline_s=10)
        assert (await sender.send(ticket, [(0, 4, tensor)], backend=backend)).ok
        assert torch.equal(sink.dst, tensor)


async def test_the_ticket_survives_msgpack_and_rejects_malformed_input(receiver):
    ticket = receiver.expect("tk", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=10)
    decode = msgspec.msgpack.Decoder(TransferTicket).decode
    wire = msgspec.to_builtins(ticket, builtin_types=(bytes,))
    assert decode(msgpack.packb(wire, use_bin_type=True)) == ticket
    assert len(ticket.token) == 32 and ticket.endpoint.tls is False
    assert "token" in wire and ticket.token.hex() not in repr(ticket) and "secret" in repr(ticket)
    for broken in ({}, {**wire, "token": "not-bytes"}, {**wire, "token": b"short"}, {**wire, "endpoint": {"host": "x"}},
                   {**wire, "endpoint": {**wire["endpoint"], "tls": "yes"}},
                   {**wire, "endpoint": {**wire["endpoint"], "port": 70000}},
                   {**wire, "deadline_unix_s": "soon"}, {**wire, "transfer_id": ""}, {**wire, "extra": 1}):
        with pytest.raises(msgspec.ValidationError):
            decode(msgpack.packb(broken, use_bin_type=True))


async def test_shm_segments_are_reused_and_gone_after_close(receiver):
    sender = KVSender()
    src = kv(4, seed=7)
    try:
        sender.prewarm_shm()
        prewarmed = segments_with_prefix(sender.shm_pool.prefix)
        assert len(prewarmed) >= 2 and sender.shm_pool.in_use_bytes == 0
        for i in range(3):
            ticket = receiver.expect(f"reuse-{i}", on_part=Sink(src), total_layers=(0, 4), deadline_s=10)
            assert (await sender.send(ticket, [(0, 4, src)], backend="shm")).ok
        assert segments_with_prefix(sender.shm_pool.prefix) == prewarmed  # the prewarmed ones served all three
        assert sender.shm_pool.in_use_bytes == 0
    finally:
        sender.close()
    assert segments_with_prefix(sender.shm_pool.prefix) == []


async def test_several_senders_deliver_one_transfer_each_its_own_layers(receiver):
    # As the stages of a pipelined prefill pool do: each ships its own layers of the prompt's KV.
    src = kv(6, seed=11)
    sink = Sink(src)
    ticket = receiver.expect("split", on_part=sink, total_layers=(0, 6), deadline_s=10)
    first, second = KVSender(), KVSender()
    try:
        sent_a, sent_b, got = await asyncio.gather(
            first.send(ticket, [(layer, layer + 1, src[layer:layer + 1]) for layer in range(0, 2)], backend="shm",
                       layers=(0, 2)),
            second.send(ticket, [(2, 6, src[2:6])], backend="tcp", layers=(2, 6)),
            receiver.wait("split"),
        )
        assert sent_a.ok and sent_b.ok and got.ok, (sent_a, sent_b, got)
        assert torch.equal(sink.dst, src) and sorted(sink.layers) == list(range(6))
    finally:
        first.close()
        second.close()


async def test_a_sender_ending_its_claim_leaves_the_transfer_open_for_the_rest(receiver, sender):
    src = kv(4, seed=12)
    sink = Sink(src)
    ticket = receiver.expect("half", on_part=sink, total_layers=(0, 4), deadline_s=10)
    sent = await sender.send(ticket, [(0, 2, src[0:2])], backend="tcp", layers=(0, 2))
    assert sent.ok and receiver.num_active == 1  # layers 2-3 are still to come
    sent = await sender.send(ticket, [(2, 4, src[2:4])], backend="shm", layers=(2, 4))
    assert sent.ok and (await receiver.wait("half")).ok and torch.equal(sink.dst, src)


async def test_parts_outside_the_claim_or_a_claim_outside_the_transfer_are_refused(receiver, sender):
    src = kv(4, seed=13)
    ticket = receiver.expect("claims", on_part=Sink(src), total_layers=(0, 4), deadline_s=10)
    sent = await sender.send(ticket, [(0, 1, src[0:1])], backend="tcp", layers=(2, 6))
    assert not sent.ok and sent.reason == "bad-input" and receiver.num_active == 1  # the transfer is untouched
    sent = await sender.send(ticket, [(0, 1, src[0:1])], backend="tcp", layers=(2, 4))
    assert not sent.ok and sent.reason == "protocol"
    assert not (await receiver.wait("claims")).ok


async def test_a_sender_counts_its_sends_in_flight(receiver, sender):
    """What a prefill worker reads before it lends its CPUs (it never lends them while it still ships KV)."""
    src = kv(2)
    sink = Sink(src)
    ticket = receiver.expect("counted", on_part=sink, total_layers=(0, 2), deadline_s=10)
    gate = asyncio.Event()

    async def parts():
        yield 0, 1, src[0:1]
        await gate.wait()
        yield 1, 2, src[1:2]

    sending = asyncio.create_task(sender.send(ticket, parts()))
    await eventually(lambda: sink.calls, what="the first part applied")
    assert sender.sends_in_flight == 1
    gate.set()
    assert (await sending).ok and sender.sends_in_flight == 0
