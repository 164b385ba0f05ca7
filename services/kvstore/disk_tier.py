"""The kv-store's disk tier: one file per block under a directory, bounded in bytes, least recently used out first.

A file is `<dir>/<first two hex digits>/<hash hex>.kvb`: a magic line, a tag, a
length-prefixed msgpack header (the block's hash, the model fingerprint, dtype,
shape, the checksum the block got when it first arrived) and the raw payload.
The tag is an HMAC of the rest keyed by this store's secret (`<dir>/store.key`,
made 0600 on first use): a file this store did not write (planted, or another
store's) is dropped and counted, as is one whose header names another hash than
the one asked for (copied or renamed) and one that does not read back. A block
already on disk is never replaced: the first write stands. Files are written to a temporary name and renamed, so a crash never
leaves a half-written block under a real name. A restarted store finds its
blocks again by scanning the directory (their order of use from the files'
access times); a file that does not read back (truncated, corrupted, foreign)
is deleted and counts as a miss.
"""

import hashlib
import hmac
import os
import secrets
import struct
import time
from collections import OrderedDict
from pathlib import Path

import msgpack

from services.kvstore.block import StoredBlock
from shared.private_files import private_dir, write_private

MAGIC = b"splitserve-kv-block/3\n"
SUFFIX = ".kvb"
KEY_FILE = "store.key"
_TAG_BYTES = hashlib.sha256().digest_size
_LENGTH = struct.Struct("!I")
_MAX_HEADER = 4096


class ForgedBlockFile(ValueError):
    """A block file whose tag this store's secret did not make."""


def store_key(root: Path) -> bytes:
    """The store's secret, kept beside its blocks (a restart reads them back with it); made on first use."""
    path = root / KEY_FILE
    if not path.exists():
        write_private(path, secrets.token_bytes(32))
    return path.read_bytes()


def _tag(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


class DiskTier:
    def __init__(self, root: str | os.PathLike, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError("the disk tier's capacity cannot be negative")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        private_dir(self.root)  # users' KV: the store's user alone reads it
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self.bytes_used = 0
        self.evictions = 0
        self.dropped_corrupt = 0
        self.dropped_misnamed = 0  # a file holding another block than its name says
        self.dropped_forged = 0  # a file this store did not write
        self._key = store_key(self.root)
        self._scan()

    # ---- the index ---------------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                key = bytes.fromhex(path.name.removesuffix(SUFFIX))
                st = path.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_atime, key, st.st_size))
        for path in self.root.glob("*/*.tmp-*"):  # a write that a crash interrupted
            path.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self.bytes_used += size
        self._evict_to(self.capacity_bytes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[bytes]:
        return list(self._sizes)

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}{SUFFIX}"

    # ---- blocks -------------------------------------------------------------------------------
    def put(self, key: bytes, block: StoredBlock) -> list[bytes]:
        """Store `block` unless a block is there under `key` already; returns the keys evicted to make room."""
        header = msgpack.packb({"hash": key, "model": block.model_fingerprint, "dtype": block.dtype,
                                "shape": list(block.shape), "sum": block.checksum})
        body = _LENGTH.pack(len(header)) + header
        size = len(MAGIC) + _TAG_BYTES + len(body) + block.nbytes
        if size > self.capacity_bytes or key in self._sizes:
            return []  # does not fit at all, or the first write stands
        evicted = self._evict_to(self.capacity_bytes - size)
        path = self._path(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(MAGIC + _tag(self._key, body, block.data) + body)
            f.write(block.data)
        os.replace(tmp, path)
        self._sizes[key] = size
        self.bytes_used += size
        return evicted

    def get(self, key: bytes) -> StoredBlock | None:
        if key not in self._sizes:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
            stored_key, block = _parse(raw, self._key)
        except ForgedBlockFile:
            self.dropped_forged += 1
            self.discard(key)
            return None
        except (OSError, ValueError, TypeError, struct.error):
            self.dropped_corrupt += 1
            self.discard(key)
            return None
        if stored_key != key:
            self.dropped_misnamed += 1
            self.discard(key)
            return None
        self._sizes.move_to_end(key)
        now = time.time()
        try:
            os.utime(path, (now, now))  # the order of use survives a restart
        except OSError:
            pass
        return block

    def discard(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.bytes_used -= size
            self._path(key).unlink(missing_ok=True)

    def _evict_to(self, limit: int) -> list[bytes]:
        evicted = []
        while self._sizes and self.bytes_used > max(limit, 0):
            key, size = self._sizes.popitem(last=False)
            self.bytes_used -= size
            self._path(key).unlink(missing_ok=True)
            self.evictions += 1
            evicted.append(key)
        return evicted


def _parse(raw: bytes, key: bytes) -> tuple[bytes, StoredBlock]:
    """(the hash the file says it holds, the block): a ValueError if the file does not read back (corrupt), a
    ForgedBlockFile if it does but this store did not write it."""
    if not raw.startswith(MAGIC):
        raise ValueError("not a kv block file")
    offset = len(MAGIC) + _TAG_BYTES
    (length,) = _LENGTH.unpack_from(raw, offset)
    if length > _MAX_HEADER:
        raise ValueError("block file header too long")
    header = msgpack.unpackb(raw[offset + _LENGTH.size : offset + _LENGTH.size + length])
    data = raw[offset + _LENGTH.size + length :]
    if not isinstance(header, dict) or not isinstance(header.get("sum"), int):
        raise ValueError("block file header is not a map with the block's checksum")
    block = StoredBlock(header.get("dtype"), tuple(header.get("shape") or ()), data, bytes(header.get("model") or b""),
                        header["sum"])
    if not hmac.compare_digest(raw[len(MAGIC) : offset], _tag(key, memoryview(raw)[offset:])):
        raise ForgedBlockFile("the block file's tag is not this store's")
    return header.get("hash"), block
