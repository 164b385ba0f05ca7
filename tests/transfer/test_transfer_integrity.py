"""Integrity: checksums catch what they promise; a corrupted payload is rejected and never applied."""

import asyncio

import pytest
import torch

from shared.transfer import KVSender
from shared.transfer.checksum import ROW_BYTES, as_bytes, checksum, crc32, fold64
from transfer_helpers import RawClient, Sink, kv

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


@pytest.mark.parametrize("algorithm", ["fold64", "crc32"])
@pytest.mark.parametrize("nbytes", [1, 7, ROW_BYTES, 3 * ROW_BYTES + 5, 1 << 20])
async def test_checksums_see_every_single_byte_change(algorithm, nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    reference = checksum(algorithm, data)
    assert checksum(algorithm, data.clone()) == reference
    positions = sorted({0, nbytes // 2, nbytes - 1, min(ROW_BYTES, nbytes - 1), max(nbytes - ROW_BYTES, 0)})
    for position in positions:
        for flip in (0x01, 0x80, 0xFF):
            changed = data.clone()
            changed[position] ^= flip
            assert checksum(algorithm, changed) != reference, (position, flip)


async def test_fold64_sees_moved_rows_and_another_length():
    data = torch.randint(0, 256, (8 * ROW_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    rows = data.view(8, ROW_BYTES)
    swapped = rows[[1, 0, 2, 3, 4, 5, 6, 7]].reshape(-1)
    assert fold64(swapped) != fold64(data)
    assert fold64(data[:-1]) != fold64(data)
    assert fold64(torch.cat([data, torch.zeros(8, dtype=torch.uint8)])) != fold64(data)  # zero padding shows
    assert fold64(data[1:]) == fold64(data[1:].clone())  # an unaligned view gives the same answer
    assert crc32(data) != crc32(swapped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_a_byte_flipped_in_flight_over_tcp_is_rejected(receiver, dtype):
    """A hand-made sender: right token, right checksum of the real bytes, one byte flipped on the wire."""
    src = kv(2, dtype, seed=3)
    sink = Sink(src)
    ticket = receiver.expect("flip", on_part=sink, total_layers=(0, 2), deadline_s=10)
    payload = bytearray(as_bytes(src).numpy().tobytes())
    header = {"op": "part", "seq": 0, "layer_start": 0, "layer_end": 2, "dtype": str(dtype).split(".")[1],
              "shape": list(src.shape), "nbytes": len(payload), "alg": "fold64", "sum": fold64(as_bytes(src))}
    payload[len(payload) // 3] ^= 0x10

    client = await RawClient.connect(ticket)
    await client.authenticate(ticket)
    assert (await client.recv())["status"] == "ready"
    client.send(header, bytes(payload))
    error = await client.recv()
    await client.closed()
    client.close()

    assert error["op"] == "error" and error["reason"] == "corrupted", error
    result = await receiver.wait("flip")
    assert not result.ok and result.reason == "corrupted"
    assert sink.calls == []  # never applied
    assert receiver.stats.corrupted_parts == 1 and receiver.stats.failed_by_reason["corrupted"] == 1


class CorruptingSender(KVSender):
    """Flips one byte of the n-th part after its checksum was taken (in the segment, or in the tcp payload)."""

    def __init__(self, corrupt_seq: int, **options):
        super().__init__(**options)
        self.corrupt_seq = corrupt_seq

    def _prepare(self, backend, flow, seq, layer_start, layer_end, tensor):
        header, payload = super()._prepare(backend, flow, seq, layer_start, layer_end, tensor)
        if seq == self.corrupt_seq:
            if backend == "shm":
                flow.parts[-1].segment.bytes[header["nbytes"] - 1] ^= 0x01
            else:
                payload = memoryview(bytearray(payload))
                payload[0] ^= 0x01
        return header, payload


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_corrupted_part_fails_both_sides_and_later_parts_are_not_applied(receiver, backend):
    src = kv(4, seed=4)
    sink = Sink(src)
    ticket = receiver.expect("bad-part", on_part=sink, total_layers=(0, 4), deadline_s=10)
    sender = CorruptingSender(corrupt_seq=1)
    try:
        parts = [(layer, layer + 1, src[layer : layer + 1]) for layer in range(4)]
        sent, got = await asyncio.gather(sender.send(ticket, parts, backend=backend), receiver.wait("bad-part"))
        assert not got.ok and got.reason == "corrupted", got
        assert not sent.ok and sent.reason == "corrupted", sent
        assert sink.calls == [(0, 1)]
        assert sender.shm_pool.in_use_bytes == 0  # the unacked segments were unlinked, not pooled
    finally:
        sender.close()
