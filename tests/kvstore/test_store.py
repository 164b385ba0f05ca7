"""The kv-store's tiers: RAM bounded and LRU, spilling to a bounded disk tier that a restart finds again."""

import pytest
import torch

from services.kvstore.block import StoredBlock
from services.kvstore.disk_tier import DiskTier
from services.kvstore.store import DISK, RAM, TieredBlockStore


def block(seed: int, numel: int = 256, dtype=torch.float32) -> StoredBlock:
    return StoredBlock.from_tensor(torch.randn(2, 2, numel // 4, generator=torch.Generator().manual_seed(seed)).to(dtype))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


SIZE = block(0).nbytes  # 1 KiB


def test_a_block_round_trips_bit_exact_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        original = torch.randn(4, 2, 16, 2, 8).to(dtype)
        back = StoredBlock.from_tensor(original).tensor()
        assert back.dtype == dtype and torch.equal(back, original)
    with pytest.raises(ValueError, match="bytes are not"):
        StoredBlock("float32", (2, 2), b"123")
    with pytest.raises(ValueError, match="dtype"):
        StoredBlock("complex", (1,), b"")


def test_ram_over_its_bound_spills_least_recently_used_to_disk(tmp_path):
    store = TieredBlockStore(ram_bytes=3 * SIZE, disk_bytes=100 * SIZE, disk_dir=tmp_path)
    for i in range(3):
        store.put(key(i), block(i))
    store.get(key(0))  # now the most recently used
    store.put(key(3), block(3))  # over the bound: key 1 (least recently used) goes to disk
    assert store.tier_of(key(1)) == DISK and store.tier_of(key(0)) == RAM
    assert store.snapshot()["ram"]["bytes"] <= 3 * SIZE
    found, tier = store.get(key(1))
    assert tier == DISK and torch.equal(found.tensor(), block(1).tensor())
    assert store.tier_of(key(1)) == RAM  # read back into RAM, another block spilled instead
    assert store.snapshot()["evictions"][RAM] == 2 and store.snapshot()["hits"] == {RAM: 1, DISK: 1}


def test_disk_over_its_bound_drops_the_oldest(tmp_path):
    disk_blocks = 4
    store = TieredBlockStore(ram_bytes=SIZE, disk_bytes=disk_blocks * (SIZE + 200), disk_dir=tmp_path)
    for i in range(10):
        store.put(key(i), block(i))
    snap = store.snapshot()
    assert snap["disk"]["bytes"] <= disk_blocks * (SIZE + 200) and snap["disk"]["blocks"] == disk_blocks
    assert snap["evictions"][DISK] == 10 - 1 - disk_blocks
    assert [store.tier_of(key(i)) for i in range(10)] == [None] * 5 + [DISK] * 4 + [RAM]
    assert store.get(key(0)) is None and store.snapshot()["misses"] == 1


def test_without_a_disk_tier_blocks_leaving_ram_are_dropped_and_counted():
    store = TieredBlockStore(ram_bytes=2 * SIZE)
    for i in range(5):
        store.put(key(i), block(i))
    assert store.snapshot()["dropped"] == 3 and store.longest_prefix([key(3), key(4)]) == 2


def test_a_restarted_store_finds_its_disk_tier_again(tmp_path):
    store = TieredBlockStore(ram_bytes=SIZE, disk_bytes=100 * SIZE, disk_dir=tmp_path)
    for i in range(5):
        store.put(key(i), block(i))
    del store  # as if killed: RAM is gone, the files stay
    again = TieredBlockStore(ram_bytes=SIZE, disk_bytes=100 * SIZE, disk_dir=tmp_path)
    assert again.longest_prefix([key(i) for i in range(5)]) == 4  # the 4 that had spilled; the last was in RAM
    found, tier = again.get(key(2))
    assert tier == DISK and torch.equal(found.tensor(), block(2).tensor())


def test_longest_prefix_counts_from_the_first_key(tmp_path):
    store = TieredBlockStore(ram_bytes=10 * SIZE)
    for i in (0, 1, 3):
        store.put(key(i), block(i))
    assert store.longest_prefix([key(0), key(1), key(2), key(3)]) == 2
    assert store.longest_prefix([key(2), key(3)]) == 0 and store.longest_prefix([]) == 0


def test_corrupt_or_truncated_files_are_misses_and_removed(tmp_path):
    disk = DiskTier(tmp_path, 100 * SIZE)
    disk.put(key(1), block(1))
    disk.put(key(2), block(2))
    path1 = disk._path(key(1))
    data = bytearray(path1.read_bytes())
    data[-1] ^= 0xFF
    path1.write_bytes(bytes(data))
    disk._path(key(2)).write_bytes(b"junk")
    assert disk.get(key(1)) is None and disk.get(key(2)) is None
    assert disk.dropped_corrupt == 2 and len(disk) == 0 and not path1.exists()
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "zz.kvb").write_bytes(b"not a hex name")  # ignored by a rescan
    (tmp_path / "ab" / "abcd.kvb.tmp-1").write_bytes(b"half written")
    rescanned = DiskTier(tmp_path, 100 * SIZE)
    assert len(rescanned) == 0 and not (tmp_path / "ab" / "abcd.kvb.tmp-1").exists()


def test_a_file_renamed_to_another_blocks_name_is_dropped_and_counted(tmp_path):
    disk = DiskTier(tmp_path, 100 * SIZE)
    disk.put(key(1), StoredBlock.from_tensor(block(1).tensor(), model_fingerprint=b"m1"))
    disk.put(key(2), block(2))
    disk._path(key(1)).replace(disk._path(key(2)))  # a valid block file, under another hash's name
    disk._path(key(1)).touch()
    again = DiskTier(tmp_path, 100 * SIZE)
    assert again.get(key(2)) is None and again.dropped_misnamed == 1 and not disk._path(key(2)).exists()
    assert again.get(key(1)) is None  # (the empty file left behind is corrupt)
    disk.put(key(3), StoredBlock.from_tensor(block(3).tensor(), model_fingerprint=b"m3"))
    assert disk.get(key(3)).model_fingerprint == b"m3"  # the model travels with the block through the disk
    assert disk._path(key(3)).stat().st_mode & 0o777 == 0o600  # nobody else reads users' KV
    assert disk._path(key(3)).parent.stat().st_mode & 0o777 == 0o700 and tmp_path.stat().st_mode & 0o077 == 0


def test_a_smaller_disk_bound_at_restart_evicts_down_to_it(tmp_path):
    disk = DiskTier(tmp_path, 100 * SIZE)
    for i in range(6):
        disk.put(key(i), block(i))
    smaller = DiskTier(tmp_path, 3 * (SIZE + 200))
    assert len(smaller) == 3 and smaller.bytes_used <= 3 * (SIZE + 200)


def test_kv_events_say_which_blocks_the_store_holds_in_any_tier(tmp_path):
    store = TieredBlockStore(ram_bytes=2 * SIZE, disk_bytes=2 * (SIZE + 200), disk_dir=tmp_path)
    for i in range(3):
        store.put(key(i), block(i))  # key 0 spills to disk: still held
    batch = store.kv_events.drain()
    assert batch.stored == [key(0), key(1), key(2)] and batch.removed == []
    store.put(key(3), block(3))
    store.put(key(4), block(4))  # disk holds two: key 0 leaves the store
    batch = store.kv_events.drain()
    assert batch.stored == [key(3), key(4)] and batch.removed == [key(0)]
    assert sorted(store.held_hashes()) == [key(i) for i in (1, 2, 3, 4)]

    without_disk = TieredBlockStore(ram_bytes=SIZE)
    without_disk.put(key(0), block(0))
    without_disk.put(key(1), block(1))  # key 0 is dropped
    batch = without_disk.kv_events.drain()
    assert batch.stored == [key(1)] and batch.removed == [key(0)]
