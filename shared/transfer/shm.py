"""POSIX shared-memory segments for the `shm` backend: the sender's pool, the receiver's mapping cache.

Why a pool and not one fresh segment per part: on the machines measured here,
the first touch of fresh shared-memory pages costs more than copying the bytes
(64 MiB on the 2-core VM this was built on: 30-50 ms to create and fill a new
segment, ~6 ms to fault an existing one into a second process, ~5 ms to copy). So a sender keeps its segments and
reuses each one once the receiver has acked the part it carried, and a
receiver keeps its mappings of a sender's segments. In steady state neither
side faults a page and each byte is copied exactly twice: once by the sender
into the segment, once by the receiver's `on_part` into its paged cache.

Once is better: a *region* (`shared_zeros`) is a long-lived tensor in shared
memory, typically a prefill worker's whole paged KV cache. A part that lies in
a region needs no pool segment at all; the receiver maps the region and its
`on_part` copies the blocks straight into its own cache.

Ownership is simple: a segment belongs to the sender that created it, always.
The receiver never unlinks; it maps, reads, acks. The sender unlinks a segment
when its pool is over its idle cap, when a transfer fails while the segment
was still in flight (it is never reused then, so a slow receiver can never
read bytes of another transfer), and at `close()`. A sender that dies
without closing leaves its segments behind: their names carry the sender's
pid-namespace, pid and process start time, so `sweep_orphan_segments()` (run by
a receiver at start and by a sender before its first shm transfer) unlinks those
whose process is gone.

Segments live in /dev/shm and are opened with plain `os.open` there, as
`shm_open(3)` does on Linux. `multiprocessing.shared_memory` is not used: on
Python 3.11 it registers every *attach* with a resource-tracker process, which
then unlinks (and warns about) segments the attaching process never owned.
"""

import atexit
import functools
import mmap
import os
import re
import secrets
import socket
import stat
import weakref
from collections import OrderedDict

import torch

from shared.telemetry.logging import get_logger

log = get_logger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ssk-"
_NAME_RE = re.compile(r"^ssk-(\d+)-(\d+)-(\d+)-[0-9a-f]{16}$")  # pid namespace, pid, start time, random
_MIN_SEGMENT_BYTES = 64 * 1024


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def host_id() -> str:
    """Identifies the shared-memory domain this process is in; two processes with equal ids can use `shm`.

    The kernel's boot id (one per running kernel, the same in every container on
    it, different on every other machine) plus the identity of the /dev/shm
    mount (containers with private /dev/shm differ; ones sharing it, as with
    `ipc: host`, agree). `SPLITSERVE_HOST_ID` overrides it.
    """
    override = os.environ.get("SPLITSERVE_HOST_ID")
    if override:
        return override
    return _detected_host_id()


@functools.cache
def _detected_host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = "boot:" + f.read().strip()
    except OSError:
        machine = "host:" + socket.gethostname()
    try:
        st = os.stat(SHM_DIR)
        shm = f"shm:{st.st_dev}.{st.st_ino}" if shm_available() else "noshm"
    except OSError:
        shm = "noshm"
    return f"{machine}/{shm}"


def shm_usable_with(peer_host_id: str) -> bool:
    mine = host_id()
    return shm_available() and peer_host_id == mine and not mine.endswith("/noshm")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[19])


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def is_segment_name(name: str) -> bool:
    return isinstance(name, str) and _NAME_RE.match(name) is not None


class Segment:
    """One mapped shared-memory segment; `bytes` is a uint8 tensor over the whole mapping."""

    __slots__ = ("name", "size", "bytes", "_mmap")

    def __init__(self, name: str, size: int, mapping: mmap.mmap):
        self.name = name
        self.size = size
        self._mmap = mapping
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)

    @classmethod
    def create(cls, name: str, size: int, *, reserve: bool = False) -> "Segment":
        """A new segment. With `reserve`, its memory is allocated now (OSError if /dev/shm is too full), so
        that touching it later can never fault with SIGBUS on a full /dev/shm."""
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            if reserve:
                os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(_path(name))
            raise
        finally:
            os.close(fd)
        _created_here.add(name)
        return cls(name, size, mapping)

    @classmethod
    def open(cls, name: str) -> "Segment":
        fd = os.open(_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
                raise OSError(f"{name} is not a shared-memory segment")
            mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, st.st_size, mapping)

    def unlink(self) -> None:
        _created_here.discard(self.name)
        try:
            os.unlink(_path(self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap, unless someone still holds a view (then the mapping goes when the last view does)."""
        self.bytes = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a tensor view is still alive somewhere; the mmap object unmaps when it is collected
            self._mmap = None


_regions: dict[str, Segment] = {}  # this process's shared regions (see `shared_zeros`), by name


def _process_prefix() -> str:
    return f"{NAME_PREFIX}{_pid_namespace()}-{os.getpid()}-{_start_time(os.getpid()) or 0}-"


def shared_zeros(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A zeroed CPU tensor in a new shared-memory segment owned by this process: a *region*.

    A region is what lets the side channel move a tensor with one copy: when a
    part sent over `shm` lies in a region, the receiver maps the region and
    copies straight out of it (see `KVSender`). It usually holds a worker's
    paged KV cache (its signature fits `PagedKVCache`'s allocator). It lives
    until this process exits (or `free_region`); a killed process's regions are
    swept like its pool segments. Raises OSError when /dev/shm has no room for it.
    """
    if torch.device(device).type != "cpu":
        raise ValueError(f"a shared-memory region lives in host memory, not on {device}")
    numel = 1
    for dim in shape:
        numel *= int(dim)
    nbytes = numel * dtype.itemsize
    size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    while True:
        try:
            segment = Segment.create(_process_prefix() + secrets.token_hex(8), size, reserve=True)  # reads as zeros
            break
        except FileExistsError:
            continue
    _regions[segment.name] = segment
    return segment.bytes[:nbytes].view(dtype).view(tuple(int(d) for d in shape))


def region_of(tensor: torch.Tensor) -> tuple[str, int] | None:
    """(region name, byte offset of the tensor's first element) when the tensor lies in one of this
    process's regions, else None."""
    if tensor.device.type != "cpu" or not _regions:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for name, segment in _regions.items():
        base = segment.bytes.data_ptr()
        if base <= start and end <= base + segment.size:
            return name, start - base
    return None


def free_region(tensor: torch.Tensor) -> None:
    """Unlink the region holding `tensor` (its memory goes when the last view and mapping do)."""
    found = region_of(tensor)
    if found is not None:
        segment = _regions.pop(found[0])
        segment.unlink()
        segment.close()


class LeaseTable:
    """A sender's leases: slots of a small region saying whether what a receiver reads in place is still held.

    A receiver copies blocks of a sender's region without a checksum pass (it
    would cost as much as the copy). What could go wrong is the sender letting
    go of the blocks (its transfer failed, its caller freed and reused them)
    while the receiver still copies. So each transfer that sends in place takes
    a slot and writes a fresh random generation into it; its parts name the
    slot and the generation; the sender zeroes the slot *before* `send` returns,
    so before its caller can free anything. The receiver reads the slot before
    and after copying a part: the generation still there after the copy means
    the blocks were held throughout (x86-64 keeps loads, and stores, in order).
    """

    def __init__(self, slots: int = 1024):
        self.slots = slots
        self.table: torch.Tensor | None = None  # int64 [slots], in a region
        self._free: list[int] = []

    def acquire(self) -> tuple[str, int, int] | None:
        """(region, byte offset, generation) of a new lease, or None when every slot is taken."""
        if self.table is None:
            self.table = shared_zeros((self.slots,), torch.int64)
            self._free = list(range(self.slots - 1, -1, -1))
        if not self._free:
            return None
        slot = self._free.pop()
        generation = secrets.randbits(63) | 1
        self.table[slot] = generation
        name, offset = region_of(self.table)
        return name, offset + slot * 8, generation

    def release(self, lease: tuple[str, int, int]) -> None:
        if self.table is None:
            return  # closed (the process is stopping): the slot went with the table
        slot = (lease[1] - region_of(self.table)[1]) // 8
        self.table[slot] = 0
        self._free.append(slot)

    def close(self) -> None:
        if self.table is not None:
            free_region(self.table)
            self.table = None
            self._free = []


def _size_class(nbytes: int) -> int:
    """Round up to one of four sizes per power of two (at most 25% slack), at least 64 KiB, page-aligned."""
    nbytes = max(nbytes, _MIN_SEGMENT_BYTES)
    step = 1 << max(nbytes.bit_length() - 3, 12)
    return -(-nbytes // step) * step


_created_here: set[str] = set()  # names of segments this process created and has not unlinked
_pools: "weakref.WeakSet[SegmentPool]" = weakref.WeakSet()  # this process's senders' pools


@atexit.register
def _unlink_created_here() -> None:
    """A process that exits without closing its sender (but is not killed) still leaves /dev/shm clean."""
    me = str(os.getpid())
    for name in list(_created_here):
        match = _NAME_RE.match(name)
        if match is None or match.group(2) != me:
            continue  # a forked child inherits the set; the segments are its parent's
        try:
            os.unlink(_path(name))
        except OSError:
            pass
    _created_here.clear()


def segments_held() -> dict:
    """The segments this process made and has not unlinked (`made`), by what holds them: its long-lived regions
    (`regions`: a KV cache, a lease table) and its senders' pools, carrying a part now (`in_use`) or kept for
    reuse (`idle`). Any other is a leak."""
    pools = list(_pools)
    in_use, idle = sum(len(p._in_use) for p in pools), sum(len(p._idle) for p in pools)
    return {"made": len(_created_here), "regions": len(_regions), "in_use": in_use, "idle": idle,
            "leaked": len(_created_here) - len(_regions) - in_use - idle}


class SegmentPool:
    """A sender's segments: `acquire` one for a part, `release` it when acked (kept) or failed (unlinked)."""

    def __init__(self, idle_bytes_cap: int):
        self.idle_bytes_cap = idle_bytes_cap
        self.prefix = _process_prefix()
        self._idle: list[Segment] = []  # least recently used first
        self._in_use: dict[str, Segment] = {}
        _pools.add(self)

    @property
    def idle_bytes(self) -> int:
        return sum(seg.size for seg in self._idle)

    @property
    def in_use_bytes(self) -> int:
        return sum(seg.size for seg in self._in_use.values())

    def names(self) -> list[str]:
        return [seg.name for seg in self._idle] + list(self._in_use)


    def acquire(self, nbytes: int) -> Segment:
        """The smallest idle segment that holds `nbytes`, else a new one (raises OSError if it cannot be made)."""
        best = None
        for seg in reversed(self._idle):  # most recently released first: its pages are likeliest still in cache
            if seg.size >= nbytes and (best is None or seg.size < best.size):
                best = seg
        if best is not None:
            self._idle.remove(best)
        else:
            size = _size_class(nbytes)
            self._trim(self.idle_bytes_cap - size)  # make room under the cap for the new one, if we can
            while True:
                try:
                    best = Segment.create(self.prefix + secrets.token_hex(8), size)
                    break
                except FileExistsError:
                    continue
        self._in_use[best.name] = best
        return best

    def release(self, seg: Segment, *, reusable: bool) -> None:
        if self._in_use.pop(seg.name, None) is None:
            return
        if reusable and seg.size <= self.idle_bytes_cap:
            self._idle.append(seg)
            self._trim(self.idle_bytes_cap)
        else:
            seg.unlink()
            seg.close()

    def _trim(self, cap: int) -> None:
        while self._idle and self.idle_bytes > max(cap, 0):
            seg = self._idle.pop(0)
            seg.unlink()
            seg.close()

    def close(self) -> None:
        for seg in [*self._idle, *self._in_use.values()]:
            seg.unlink()
            seg.close()
        self._idle.clear()
        self._in_use.clear()


class MappingCache:
    """A receiver's mappings of senders' segments, least recently used dropped first beyond `cap_bytes`.

    Names are random and never reused, so a cached mapping is always of the
    segment the sender means. Mappings of segments their sender has since
    unlinked are dropped by `drop_unlinked`, run now and then.
    """

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self._segments: OrderedDict[str, Segment] = OrderedDict()
        self.mapped_bytes = 0

    def get(self, name: str) -> Segment:
        """The mapping of segment `name`; raises ValueError for a name no sender makes, OSError if it cannot be mapped."""
        seg = self._segments.get(name)
        if seg is not None:
            self._segments.move_to_end(name)
            return seg
        if not is_segment_name(name):
            raise ValueError(f"{name!r} is not a side-channel segment name")
        seg = Segment.open(name)
        self._segments[name] = seg
        self.mapped_bytes += seg.size
        return seg

    def trim(self) -> None:
        while self.mapped_bytes > self.cap_bytes and self._segments:
            _, seg = self._segments.popitem(last=False)
            self._close(seg)

    def drop(self, name: str) -> None:
        seg = self._segments.pop(name, None)
        if seg is not None:
            self._close(seg)

    def drop_unlinked(self) -> None:
        for name in [n for n in self._segments if not os.path.exists(_path(n))]:
            self.drop(name)

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self.mapped_bytes = 0

    def _close(self, seg: Segment) -> None:
        self.mapped_bytes -= seg.size
        seg.close()


def sweep_orphan_segments() -> int:
    """Unlink the segments of senders (in this pid namespace) that have exited; returns how many."""
    if not shm_available():
        return 0
    namespace = _pid_namespace()
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        match = _NAME_RE.match(name)
        if match is None:
            continue
        ns, pid, started = (int(g) for g in match.groups())
        if ns != namespace or _start_time(pid) == started:
            continue  # another namespace's (cannot tell), or its process is alive
        try:
            os.unlink(_path(name))
            removed += 1
        except OSError:
            pass
    if removed:
        log.info("removed shared-memory segments of exited senders", count=removed)
    return removed
