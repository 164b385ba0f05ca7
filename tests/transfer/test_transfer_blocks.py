"""Parts given as blocks of a paged cache (`BlockSlice`): gathered for tcp and pooled shm, read in place by
the receiver when the cache lives in a shared-memory region (one copy in all), guarded by the sender's lease."""

import asyncio

import pytest
import torch

from shared.engine.block_slice import BlockSlice
from shared.transfer.shm import free_region, region_of, shared_zeros
from transfer_helpers import RawClient, kv

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

SOURCE_BLOCKS = (5, 6, 7, 1, 3)  # three runs
TARGET_BLOCKS = [0, 1, 4, 5, 6]


@pytest.fixture
def region_cache():
    """A paged cache `[layers, 2, blocks, block_size, heads, head_dim]` in a shared-memory region."""
    data = kv(4, blocks=8, seed=7)
    cache = shared_zeros(data.shape, data.dtype)
    cache.copy_(data)
    yield cache
    free_region(cache)


class BlockSink:
    """Copies each part into `dst`'s blocks `TARGET_BLOCKS`, as a decode worker's `write_kv` does."""

    def __init__(self, like: torch.Tensor, while_copying=None):
        self.dst = torch.zeros(like.shape[0], 2, 8, *like.shape[3:], dtype=like.dtype)
        self.kinds: list[str] = []
        self.while_copying = while_copying

    def __call__(self, start, end, part) -> None:
        layers = self.dst[start:end]
        if isinstance(part, BlockSlice):
            self.kinds.append("blocks")
            part.copy_into(layers, TARGET_BLOCKS)
            if self.while_copying is not None:
                self.while_copying()
        else:
            self.kinds.append("tensor")
            layers.index_copy_(2, torch.tensor(TARGET_BLOCKS), part)

    def received(self) -> torch.Tensor:
        return self.dst.index_select(2, torch.tensor(TARGET_BLOCKS))


def expected(cache: torch.Tensor) -> torch.Tensor:
    return cache.index_select(2, torch.tensor(SOURCE_BLOCKS))


def layer_parts(cache: torch.Tensor):
    return [(layer, layer + 1, BlockSlice(cache[layer : layer + 1], SOURCE_BLOCKS)) for layer in range(4)]


async def test_region_blocks_over_shm_are_read_in_place(receiver, sender, region_cache):
    sink = BlockSink(region_cache)
    ticket = receiver.expect("in-place", on_part=sink, total_layers=(0, 4), deadline_s=10)
    sent, got = await asyncio.gather(sender.send(ticket, layer_parts(region_cache), backend="shm"),
                                     receiver.wait("in-place"))
    assert sent.ok and got.ok, (sent, got)
    assert torch.equal(sink.received(), expected(region_cache))
    assert sink.kinds == ["blocks"] * 4  # the receiver got views of the sender's region, not copies
    assert sender.shm_pool.names() == []  # and the sender staged nothing
    assert sender.stats.in_place_parts == receiver.stats.in_place_parts == 4
    assert got.num_bytes == expected(region_cache).numel() * 4


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_blocks_outside_a_region_are_gathered(receiver, sender, backend):
    cache = kv(4, blocks=8, seed=8)
    assert region_of(cache) is None
    sink = BlockSink(cache)
    ticket = receiver.expect("gathered", on_part=sink, total_layers=(0, 4), deadline_s=10)
    sent, got = await asyncio.gather(sender.send(ticket, layer_parts(cache), backend=backend),
                                     receiver.wait("gathered"))
    assert sent.ok and got.ok, (sent, got)
    assert torch.equal(sink.received(), expected(cache))
    assert sink.kinds == ["tensor"] * 4


async def test_region_blocks_over_tcp_are_gathered(receiver, sender, region_cache):
    sink = BlockSink(region_cache)
    ticket = receiver.expect("tcp-region", on_part=sink, total_layers=(0, 4), deadline_s=10)
    sent, got = await asyncio.gather(sender.send(ticket, layer_parts(region_cache), backend="tcp"),
                                     receiver.wait("tcp-region"))
    assert sent.ok and got.ok and sink.kinds == ["tensor"] * 4
    assert torch.equal(sink.received(), expected(region_cache))


async def test_blocks_let_go_of_during_the_copy_fail_the_transfer(receiver, sender, region_cache):
    # As when the sender's send ended (deadline, error) and its caller freed the blocks mid-copy.
    sink = BlockSink(region_cache, while_copying=lambda: sender.leases.table.zero_())
    ticket = receiver.expect("released", on_part=sink, total_layers=(0, 4), deadline_s=10)
    sent, got = await asyncio.gather(sender.send(ticket, layer_parts(region_cache), backend="shm"),
                                     receiver.wait("released"))
    assert not got.ok and got.reason == "source-released", got
    assert not sent.ok and sent.reason == "source-released", sent
    assert sink.kinds == ["blocks"] and receiver.stats.in_place_parts == 0


async def test_each_send_takes_a_lease_and_gives_it_back(receiver, sender, region_cache):
    for i in range(3):
        sink = BlockSink(region_cache)
        ticket = receiver.expect(f"lease-{i}", on_part=sink, total_layers=(0, 4), deadline_s=10)
        sent, got = await asyncio.gather(sender.send(ticket, layer_parts(region_cache), backend="shm"),
                                         receiver.wait(f"lease-{i}"))
        assert sent.ok and got.ok
        assert not sender.leases.table.any()  # zeroed before send returned


def region_header(cache: torch.Tensor, **changes) -> dict:
    name, offset = region_of(cache)
    header = {"op": "part", "seq": 0, "layer_start": 0, "layer_end": 4, "dtype": "float32",
              "shape": [4, 2, 2, 4, 2, 8], "nbytes": 4 * 2 * 2 * 4 * 2 * 8 * 4,
              "shm": name, "offset": offset, "source_shape": list(cache.shape), "block_dim": 2,
              "block_runs": [[2, 2]], "lease": [name, 0, 5]}
    header.update(changes)
    return header


@pytest.mark.parametrize("changes, message", [
    ({"block_runs": [[7, 2]]}, "within the source's 8 blocks"),
    ({"block_runs": [[0, 1]]}, "is not 1 blocks"),
    ({"block_runs": [[-1, 2]]}, "within the source's"),
    ({"block_dim": 0}, "block_dim"),
    ({"source_shape": [4, 2, 8, 4, 2]}, "source_shape"),
    ({"offset": 2}, "multiple of its element size"),
    ({"offset": 1 << 20}, "overruns"),
    ({"shm": "not-a-segment"}, "cannot map"),
    ({"lease": None}, "needs a lease"),
    ({"lease": ["x", 3, 5]}, "needs a lease"),
    ({"lease": ["x", 0, 0]}, "needs a lease"),
    ({"lease": ["not-a-segment", 0, 5]}, "cannot map the sender's lease table"),
    ({}, "let go of"),  # a well-formed part whose lease does not hold
])
async def test_bad_region_part_headers_fail_the_transfer_with_a_reason(receiver, region_cache, changes, message):
    sink = BlockSink(region_cache)
    ticket = receiver.expect("bad-header", on_part=sink, total_layers=(0, 4), deadline_s=10)
    client = await RawClient.connect(ticket)
    try:
        await client.authenticate(ticket, backend="shm")
        assert (await client.recv())["status"] == "ready"
        client.send(region_header(region_cache, **changes))
        reply = await client.recv()
        assert reply["op"] == "error" and message in reply["detail"], reply
    finally:
        client.writer.close()
    result = await receiver.wait("bad-header")
    assert not result.ok and result.reason in ("protocol", "shm-error", "source-released") and sink.kinds == []


async def test_a_region_part_naming_absurdly_many_blocks_is_refused_before_any_is_listed(receiver, region_cache):
    # A uint8 "cache" whose blocks are 1 byte: the runs could name billions of ids; the header is refused first.
    sink = BlockSink(region_cache)
    ticket = receiver.expect("many", on_part=sink, total_layers=(0, 4), deadline_s=10)
    client = await RawClient.connect(ticket)
    try:
        await client.authenticate(ticket, backend="shm")
        assert (await client.recv())["status"] == "ready"
        client.send(region_header(region_cache, dtype="uint8", shape=[4, 1, 1 << 30, 1, 1, 1], nbytes=4 << 30,
                                  source_shape=[4, 1, 1 << 38, 1, 1, 1], block_runs=[[0, 1 << 30]]))
        reply = await client.recv()
        assert reply["op"] == "error", reply
    finally:
        client.writer.close()
    assert not (await receiver.wait("many")).ok and sink.kinds == []
