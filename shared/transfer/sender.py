"""`KVSender`: the prefill side of the side channel. One per process, on its asyncio loop.

`send` authenticates to the ticket's receiver (see `receiver.py` for the
protocol) over a kept connection when it has one, and streams the parts as
the iterator yields them, so layer i travels while the model computes layer
i+1. The first part is prepared while the handshake's answer is on its way.
Writing and ack-reading run concurrently: a part goes out as soon as the bytes
in flight (sent, not yet acked) leave room for it under `max_inflight_bytes`
(two parts always may be in flight). A part bigger than `split_bytes` is cut
along its first (layer) dimension, so that a one-piece KV tensor still
pipelines: the receiver applies one piece while the sender prepares the next.

Backends: `tcp` sends each payload inline, straight from the tensor's memory;
`shm` copies it into a pooled shared-memory segment (see `shm.py`) and sends
the segment's name. `auto` takes `shm` when the ticket's `host_id` equals ours.

A part may also be a `BlockSlice` (chosen blocks of a paged cache). Over
`shm`, when its source lies in a shared-memory region of this process (a
cache allocated with `shm.shared_zeros`), nothing is copied here: the part
travels as a descriptor (region, offset, shape, block runs) and the receiver
copies the blocks straight into its own cache, the one copy of the whole
transfer, guarded by a lease rather than a checksum (see `shm.LeaseTable`).
Otherwise the blocks are gathered into the segment (`shm`) or a
send buffer (`tcp`).
"""

import asyncio
import hmac
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass

import torch

from contracts import TransferTicket
from shared.bus.waits import cancel_and_wait
from shared.telemetry.logging import get_logger
from shared.transfer import checksum as checksums
from shared.engine.block_slice import BlockSlice
from shared.transfer.shm import (
    LeaseTable,
    Segment,
    SegmentPool,
    region_of,
    shm_available,
    shm_usable_with,
    sweep_orphan_segments,
)
from shared.transfer.types import (
    BAD_INPUT,
    CONNECTION,
    DEADLINE,
    PROTOCOL,
    REASONS,
    REJECTED,
    SENDER_ABORTED,
    SHM_ERROR,
    TLS,
    UNAUTHENTICATED_RECEIVER,
    TransferFailed,
    TransferResult,
    TransferStats,
)
from shared.transfer.tls import TLSChannel, TransferTLS
from shared.transfer.wire import (
    MAC_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    DTYPES,
    Channel,
    configure_socket,
    receiver_proof,
    sender_proof,
)

log = get_logger(__name__)

Part = tuple[int, int, "torch.Tensor | BlockSlice"]
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_DESCRIBED_RUNS = 2048  # a part of more scattered blocks is gathered instead (its header would be too long)


@dataclass(slots=True)
class _InFlight:
    seq: int
    nbytes: int
    segment: Segment | None


class _Flow:
    """One transfer's parts in flight, oldest first, and the room they leave."""

    def __init__(self, cap: int):
        self.cap = cap
        self.parts: deque[_InFlight] = deque()
        self.lease: tuple[str, int, int] | None = None  # held while parts are read in place (see LeaseTable)
        self.bytes = 0
        self.acked_bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    async def wait_room(self, nbytes: int) -> None:
        # Two parts may always be in flight (else parts above half the cap would not pipeline).
        while len(self.parts) >= 2 and self.bytes + nbytes > self.cap:
            self._room.clear()
            await self._room.wait()

    def push(self, entry: _InFlight) -> None:
        self.parts.append(entry)
        self.bytes += entry.nbytes

    def pop(self, seq: int) -> _InFlight:
        if not self.parts or self.parts[0].seq != seq:
            raise TransferFailed(PROTOCOL, f"the receiver acked part {seq}, which is not the oldest in flight")
        entry = self.parts.popleft()
        self.bytes -= entry.nbytes
        self.acked_bytes += entry.nbytes
        self._room.set()
        return entry


class KVSender:
    """Sends KV parts to a `KVReceiver`.

    `max_inflight_bytes`: sent-but-unacked bytes per transfer, or two parts if
    they are larger (for `shm`, this bounds the shared memory a transfer holds;
    small, it also keeps the segments in cache). `split_bytes`: larger parts
    are cut by layers (small pieces pipeline better: the receiver applies one
    while the sender prepares the next); parts read in place are cut at
    `in_place_split_bytes` at most. `checksum`: "fold64" (default) or "crc32". `io_timeout_s`: a
    single read or write that makes no progress this long fails the transfer.
    `shm_pool_bytes`: idle segments kept for reuse. `max_idle_connections`
    per receiver endpoint are kept open for `keep_connections_s` (below the
    receiver's `idle_connection_s`) for the next transfers. With `tls`
    (`shared.transfer.tls`) it dials only receivers that take TLS, and checks their certificate.
    """

    def __init__(
        self,
        *,
        max_inflight_bytes: int = 8 << 20,
        split_bytes: int = 2 << 20,
        in_place_split_bytes: int = 64 << 20,
        checksum: str = "fold64",
        io_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        shm_pool_bytes: int = 256 << 20,
        max_idle_connections: int = 4,
        keep_connections_s: float = 20.0,
        connect_attempts: int = 5,
        tls: TransferTLS | None = None,
    ):
        if checksum not in checksums.ALGORITHMS:
            raise ValueError(f"unknown checksum {checksum!r}; known: {', '.join(checksums.ALGORITHMS)}")
        if max_inflight_bytes <= 0 or split_bytes <= 0:
            raise ValueError("max_inflight_bytes and split_bytes must be positive")
        self.max_inflight_bytes = max_inflight_bytes
        self.split_bytes = split_bytes
        self.in_place_split_bytes = in_place_split_bytes
        self.checksum = checksum
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self.stats = TransferStats()
        self.sends_in_flight = 0  # `send` calls not yet returned
        self.max_idle_connections = max_idle_connections
        self.keep_connections_s = keep_connections_s
        self.connect_attempts = connect_attempts  # a connection lost before the receiver took anything is made again
        self._pool = SegmentPool(shm_pool_bytes)
        self.leases = LeaseTable()
        self._idle: dict[tuple[str, int], list[Channel]] = {}
        self._swept = False

    @property
    def shm_pool(self) -> SegmentPool:
        return self._pool

    def prewarm_shm(self) -> None:
        """Create and fault in the segments one transfer at the in-flight cap uses, so that the first
        transfers do not pay for fresh shared-memory pages (on some VMs slower than copying them)."""
        if not shm_available():
            return
        count = max(2, -(-self.max_inflight_bytes // self.split_bytes) + 1)
        segments = [self._pool.acquire(self.split_bytes) for _ in range(count)]
        for segment in segments:
            segment.bytes.zero_()
            self._pool.release(segment, reusable=True)

    def close(self) -> None:
        """Close kept connections and unlink every shared-memory segment this sender made.

        Call it when no `send` is running (at shutdown)."""
        for kept in self._idle.values():
            for channel in kept:
                channel.close()
        self._idle.clear()
        self._pool.close()
        self.leases.close()

    async def send(self, ticket: TransferTicket, parts: "AsyncIterable[Part] | Iterable[Part]", *,
                   backend: str = "auto", layers: tuple[int, int] | None = None) -> TransferResult:
        """Send every part to the ticket's receiver; ok once the receiver applied them all. Ends by the deadline.

        `parts` yields `(layer_start, layer_end, tensor)` with `tensor.shape[0] ==
        layer_end - layer_start`, in any order, each layer once; `tensor` may be a
        `BlockSlice`. An async iterator is consumed as it produces. The tensors
        are only read, and not kept after `send` returns; one that lies in a
        shared-memory region is read by the receiver in place, so it must not
        change until `send` returns. If the transfer fails while an async
        generator is producing, the generator is interrupted (cancelled at its
        `await`). `layers`: the layers this sender delivers, when other senders
        deliver the rest of the ticket's (default: all of them).
        """
        self.sends_in_flight += 1
        try:
            return await self._send(ticket, parts, backend, layers)
        finally:
            self.sends_in_flight -= 1

    async def _send(self, ticket: TransferTicket, parts, backend: str, layers: tuple[int, int] | None) -> TransferResult:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        flow = _Flow(self.max_inflight_bytes)
        chosen = backend
        parts = _Replayable(parts)
        try:
            chosen = self._choose_backend(ticket, backend)
            remaining = ticket.deadline_unix_s - time.time()
            if remaining <= 0:
                raise TransferFailed(DEADLINE, "the transfer's deadline had passed before it started")
            channel = None
            try:
                async with asyncio.timeout_at(loop.time() + remaining) as deadline:
                    for attempt in range(self.connect_attempts):
                        try:
                            channel = await self._open(ticket)
                            await self._transfer(channel, ticket, parts, chosen, flow, layers)
                            break
                        except _ConnectionLost as lost:
                            # Nothing reached the receiver: a new connection starts the transfer afresh (the
                            # receiver may have closed an idle kept one, or shed it among a flood of others).
                            if attempt + 1 == self.connect_attempts or parts.broken:
                                raise lost.failure from None
                            if channel is not None:
                                channel.close()
                                channel = None
                            self._abandon(flow)
                            flow = _Flow(self.max_inflight_bytes)
                            self.stats.retried_connections += 1
                            await asyncio.sleep(0.01 * 2**attempt)
                self._park(ticket, channel)
                channel = None
            except TimeoutError:
                if deadline.expired():
                    raise TransferFailed(DEADLINE, "the transfer's deadline passed") from None
                raise
            finally:
                if channel is not None:
                    channel.close()
                self._abandon(flow)
        except TransferFailed as failure:
            result = TransferResult.failed(failure, chosen, flow.acked_bytes, time.perf_counter() - started)
            log.info("kv send failed", transfer_id=ticket.transfer_id, reason=failure.reason, error=str(failure),
                     backend=chosen)
        else:
            result = TransferResult(True, None, chosen, flow.acked_bytes, time.perf_counter() - started)
        self.stats.record(result)
        return result

    def _abandon(self, flow: _Flow) -> None:
        """Let go of what a transfer's parts still hold: segments never acked (the receiver may still read
        them, so never reused) and the lease on blocks read in place (the caller may free those at once)."""
        for entry in flow.parts:
            if entry.segment is not None:
                self._pool.release(entry.segment, reusable=False)
        flow.parts.clear()
        if flow.lease is not None:
            self.leases.release(flow.lease)
            flow.lease = None

    def _choose_backend(self, ticket: TransferTicket, backend: str) -> str:
        if backend == "auto":
            backend = "shm" if shm_usable_with(ticket.endpoint.host_id) else "tcp"
        elif backend == "shm" and not shm_available():
            raise TransferFailed(SHM_ERROR, "shm was asked for but this process has no /dev/shm")
        elif backend not in ("shm", "tcp"):
            raise TransferFailed(BAD_INPUT, f"unknown backend {backend!r}; use auto, shm or tcp")
        if backend == "shm" and not self._swept:
            self._swept = True
            sweep_orphan_segments()
        return backend

    # -- connections -----------------------------------------------------------------------------------

    async def _open(self, ticket: TransferTicket) -> Channel:
        """A kept connection to the ticket's receiver if one is alive, else a new one (hello read)."""
        kept = self._idle.get(_endpoint_key(ticket))
        while kept:
            channel = kept.pop()
            if time.monotonic() - channel.last_used < self.keep_connections_s and not channel.peer_closed_or_chatty():
                return channel
            channel.close()
        return await self._connect(ticket)

    def _park(self, ticket: TransferTicket, channel: Channel) -> None:
        kept = self._idle.setdefault(_endpoint_key(ticket), [])
        if len(kept) >= self.max_idle_connections or channel.has_buffered():
            channel.close()
            return
        channel.last_used = time.monotonic()
        kept.append(channel)

    async def _connect(self, ticket: TransferTicket) -> Channel:
        loop = asyncio.get_running_loop()
        host, port = ticket.endpoint.host, ticket.endpoint.port
        wants_tls = ticket.endpoint.tls
        if wants_tls != (self.tls is not None):
            raise TransferFailed(TLS, f"the receiver at {host}:{port} takes TLS only and this sender has no "
                                      "side-channel TLS (--transfer-tls-ca ...)" if wants_tls else
                                      f"the receiver at {host}:{port} does not take TLS and this sender sends "
                                      "only over TLS")
        self.stats.connections += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, _, _, _, address = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.setblocking(False)
                    await loop.sock_connect(sock, address)
                except BaseException:
                    sock.close()
                    raise
        except (OSError, TimeoutError) as exc:
            raise _ConnectionLost(TransferFailed(CONNECTION, f"cannot connect to the receiver at {host}:{port}: "
                                                             f"{exc or type(exc).__name__}")) from None
        try:
            configure_socket(sock)
            if self.tls is not None:
                sock = self.tls.client.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:  # reset at once, or a host name TLS cannot check
            sock.close()
            raise _ConnectionLost(TransferFailed(CONNECTION, f"cannot open a connection to {host}:{port}: {exc}")) from None
        channel = TLSChannel(sock, self.io_timeout_s) if self.tls is not None else Channel(sock, self.io_timeout_s)
        try:
            if self.tls is not None:
                async with asyncio.timeout(self.connect_timeout_s):
                    await channel.handshake()
            hello = await channel.recv_msg()
        except TimeoutError:
            channel.close()
            raise _ConnectionLost(TransferFailed(CONNECTION, f"no TLS handshake with {host}:{port} within "
                                                             f"{self.connect_timeout_s:g}s")) from None
        except TransferFailed as failure:
            channel.close()
            raise (_ConnectionLost(failure) if failure.reason == CONNECTION else failure) from None
        except BaseException:
            channel.close()
            raise
        nonce = hello.get("nonce")
        if hello.get("v") != PROTOCOL_VERSION or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            channel.close()
            raise TransferFailed(PROTOCOL, f"the receiver speaks another protocol (version {hello.get('v')!r})")
        channel.receiver_nonce = nonce
        return channel

    # -- one transfer ----------------------------------------------------------------------------------

    async def _transfer(self, channel: Channel, ticket: TransferTicket, parts, backend: str, flow: _Flow,
                        layers: tuple[int, int] | None) -> None:
        """Authenticate, then stream. The writer prepares the first part while the handshake's answer travels."""
        sender_nonce = secrets.token_bytes(NONCE_BYTES)
        tid = ticket.transfer_id
        auth = {"v": PROTOCOL_VERSION, "transfer_id": tid, "nonce": sender_nonce, "backend": backend,
                "mac": sender_proof(ticket.token, tid, channel.receiver_nonce, sender_nonce)}
        if layers is not None:
            auth["layers"] = [int(layers[0]), int(layers[1])]
        await channel.send_msg(auth)
        ready = asyncio.get_running_loop().create_future()  # True: go; False: already delivered, send nothing
        writer = asyncio.create_task(self._write(channel, parts, backend, flow, ready), name="kv-send-write")
        reader = asyncio.create_task(self._read(channel, ticket, sender_nonce, backend, flow, ready),
                                     name="kv-send-read")
        try:
            done, _ = await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_EXCEPTION)
            for task in (reader, writer):  # the receiver's word first: it says why, the writer's error follows
                if task in done and task.exception() is not None:
                    raise task.exception()
            await writer
            await reader
        except TransferFailed as failure:
            if failure.reason == CONNECTION and not (ready.done() and not ready.cancelled()):
                raise _ConnectionLost(failure) from None  # before the receiver's go: it took nothing
            raise
        finally:
            ready.cancel()
            await cancel_and_wait(writer, reader, timeout_s=2.0)

    async def _read(self, channel: Channel, ticket: TransferTicket, sender_nonce: bytes, backend: str, flow: _Flow,
                    ready: asyncio.Future) -> None:
        reply = await channel.recv_msg()
        status = reply.get("status")
        if status == "rejected":
            raise TransferFailed(REJECTED, "the receiver does not expect this transfer with this token "
                                           "(unknown, expired or wrong token)")
        mac = reply.get("mac")
        expected = receiver_proof(ticket.token, ticket.transfer_id, channel.receiver_nonce, sender_nonce)
        if not isinstance(mac, bytes) or len(mac) != MAC_BYTES or not hmac.compare_digest(mac, expected):
            raise TransferFailed(UNAUTHENTICATED_RECEIVER, "the receiver could not prove it knows the token")
        if status == "finished":
            if reply.get("outcome") == "ok":
                ready.set_result(False)  # delivered by an earlier connection: this was a retry
                return
            raise _remote_failure(reply.get("outcome"), reply.get("detail"))
        if status == "bad-claim":
            raise TransferFailed(BAD_INPUT, f"the receiver refused the layers claimed: {str(reply.get('detail'))[:200]}")
        if status == "unsupported-backend":
            raise TransferFailed(SHM_ERROR, f"the receiver cannot use {backend}: {str(reply.get('detail'))[:200]}")
        if status != "ready":
            raise TransferFailed(PROTOCOL, f"unexpected handshake status {str(status)[:40]!r}")
        ready.set_result(True)
        while True:
            msg = await channel.recv_msg(idle_ok=True)
            op = msg.get("op")
            if op == "ack":
                entry = flow.pop(msg.get("seq"))
                if entry.segment is not None:
                    self._pool.release(entry.segment, reusable=True)
                self.stats.bytes_by_backend[backend] += entry.nbytes
            elif op == "done":
                if flow.parts:
                    raise TransferFailed(PROTOCOL, f"the receiver said done with {len(flow.parts)} parts unacked")
                return
            elif op == "error":
                raise _remote_failure(msg.get("reason"), msg.get("detail"))
            else:
                raise TransferFailed(PROTOCOL, f"unexpected message op {str(op)[:40]!r}")

    async def _write(self, channel: Channel, parts: "_Replayable", backend: str, flow: _Flow,
                     ready: asyncio.Future) -> None:
        seq = 0
        current = None  # the part being sent: handed back if the connection is lost before the receiver's go
        try:
            while True:
                try:
                    current = await parts.next()
                    layer_start, layer_end, tensor = current
                except StopAsyncIteration:
                    current = None
                    break
                except TransferFailed:
                    raise
                except Exception as exc:  # the caller's producer failed: tell the receiver so it fails now
                    raise TransferFailed(SENDER_ABORTED, f"the part producer raised {exc!r}") from exc
                for *piece, in_place in self._split(backend, layer_start, layer_end, tensor):
                    # Parts read in place hold no memory of ours while in flight.
                    await flow.wait_room(0 if in_place else _nbytes(piece[2]))
                    try:
                        header, payload = self._prepare(backend, flow, seq, *piece)
                    except TransferFailed:
                        raise
                    except Exception as exc:  # torch refused the tensor (a view it cannot copy, ...)
                        raise TransferFailed(BAD_INPUT, f"cannot send layers [{piece[0]}, {piece[1]}): {exc!r}") from exc
                    if not await ready:
                        return  # already delivered; the prepared part is released with the flow
                    await channel.send_msg(header)
                    if payload is not None:
                        await channel.send_payload(payload)
                    del payload
                    seq += 1
                current = None
        except TransferFailed as failure:
            self._hand_back(parts, current, ready)
            already_delivered = ready.done() and not ready.cancelled() and ready.result() is False
            if failure.reason in (BAD_INPUT, SENDER_ABORTED, SHM_ERROR) and not already_delivered:
                channel.try_send_msg({"op": "abort", "detail": str(failure)})
            raise
        except BaseException:  # cancelled: the reader failed, or the deadline
            self._hand_back(parts, current, ready)
            raise
        if await ready:
            await channel.send_msg({"op": "end", "parts": seq})

    @staticmethod
    def _hand_back(parts: "_Replayable", current, ready: asyncio.Future) -> None:
        """Before the receiver's go nothing of `current` was sent: a new connection sends it again."""
        if current is not None and not (ready.done() and not ready.cancelled() and ready.result()):
            parts.put_back(current)

    def _split(self, backend: str, layer_start, layer_end, tensor):
        """(layer_start, layer_end, piece, read in place) for each piece the part is cut into."""
        if not isinstance(tensor, (torch.Tensor, BlockSlice)):
            raise TransferFailed(BAD_INPUT, f"a part's tensor is a {type(tensor).__name__}")
        if not (isinstance(layer_start, int) and isinstance(layer_end, int) and 0 <= layer_start < layer_end):
            raise TransferFailed(BAD_INPUT, f"a part's layers [{layer_start!r}, {layer_end!r}) are not a range")
        shape = tensor.shape
        if len(shape) < 1 or shape[0] != layer_end - layer_start:
            raise TransferFailed(BAD_INPUT, f"a part of layers [{layer_start}, {layer_end}) has shape "
                                            f"{tuple(shape)}: its first dimension must be the layers")
        if tensor.dtype not in _DTYPE_NAMES:
            raise TransferFailed(BAD_INPUT, f"dtype {tensor.dtype} cannot be sent")
        in_place = backend == "shm" and isinstance(tensor, BlockSlice) and region_of(tensor.source) is not None
        # Pieces pipeline the sender's staging with the receiver's copy; in place, there is no staging.
        split_bytes = max(self.split_bytes, self.in_place_split_bytes) if in_place else self.split_bytes
        num_layers = layer_end - layer_start
        layer_bytes = _nbytes(tensor) // num_layers
        per_piece = max(1, min(num_layers, split_bytes // max(layer_bytes, 1)))
        for first in range(0, num_layers, per_piece):
            last = min(first + per_piece, num_layers)
            piece = tensor.narrow(first, last) if isinstance(tensor, BlockSlice) else tensor[first:last]
            yield layer_start + first, layer_start + last, piece, in_place

    def _prepare(self, backend: str, flow: _Flow, seq: int, layer_start: int, layer_end: int,
                 tensor: "torch.Tensor | BlockSlice") -> tuple[dict, memoryview | None]:
        """The part's header and (tcp) its payload bytes; for shm, the bytes are copied into a segment here,
        unless they are blocks of a shared region, which the receiver reads in place."""
        nbytes = _nbytes(tensor)
        header = {"op": "part", "seq": seq, "layer_start": layer_start, "layer_end": layer_end,
                  "dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "nbytes": nbytes,
                  "alg": self.checksum}
        if isinstance(tensor, BlockSlice) and tensor.device.type != "cpu":
            tensor = tensor.gather().to("cpu")  # no device-to-device path: stage through host memory
        if backend == "shm" and isinstance(tensor, BlockSlice):
            region = region_of(tensor.source)
            runs = tensor.runs()
            if region is not None and len(runs) <= _MAX_DESCRIBED_RUNS and flow.lease is None:
                flow.lease = self.leases.acquire()
            if region is not None and len(runs) <= _MAX_DESCRIBED_RUNS and flow.lease is not None:
                # Read in place: guarded by the lease, not a checksum (see LeaseTable).
                del header["alg"]
                header.update(shm=region[0], offset=region[1], source_shape=list(tensor.source.shape),
                              block_dim=tensor.block_dim, block_runs=[[first, count] for _, first, count in runs],
                              lease=list(flow.lease))
                flow.push(_InFlight(seq, nbytes, None))
                self.stats.in_place_parts += 1
                return header, None
        if backend == "tcp":
            if isinstance(tensor, BlockSlice):
                data = tensor.gather()
            else:
                data = tensor.detach()
                if data.device.type != "cpu":
                    data = data.to("cpu")
                data = data.contiguous()
            payload = checksums.as_bytes(data)
            header["sum"] = checksums.checksum(self.checksum, payload)
            flow.push(_InFlight(seq, nbytes, None))
            return header, memoryview(payload.numpy())
        try:
            segment = self._pool.acquire(nbytes)
        except OSError as exc:
            raise TransferFailed(SHM_ERROR, f"cannot create a shared-memory segment of {nbytes} bytes: {exc}") from None
        flow.push(_InFlight(seq, nbytes, segment))
        payload = segment.bytes[:nbytes]
        if nbytes:
            into = payload.view(tensor.dtype).view(tensor.shape)
            if isinstance(tensor, BlockSlice):
                tensor.gather(out=into)
            else:
                into.copy_(tensor.detach())
        header["sum"] = checksums.checksum(self.checksum, payload)
        header["shm"] = segment.name
        header["offset"] = 0
        return header, None


def _nbytes(tensor: "torch.Tensor | BlockSlice") -> int:
    return tensor.nbytes if isinstance(tensor, BlockSlice) else tensor.numel() * tensor.element_size()


class _Replayable:
    """The caller's parts, read once, with room to put back the one a lost connection had taken."""

    def __init__(self, parts):
        self._iterator = _each(parts).__aiter__()
        self._back: list = []
        self.broken = False  # the producer was interrupted (or failed): it cannot be read again

    async def next(self):
        if self._back:
            return self._back.pop()
        try:
            return await self._iterator.__anext__()
        except StopAsyncIteration:
            raise
        except BaseException:
            self.broken = True
            raise

    def put_back(self, part) -> None:
        self._back.append(part)


class _ConnectionLost(Exception):
    """The connection failed before the receiver took anything (`failure` says how): safe to make anew."""

    def __init__(self, failure: TransferFailed):
        super().__init__(str(failure))
        self.failure = failure


async def _each(parts):
    """Iterate sync or async iterables alike."""
    if hasattr(parts, "__aiter__"):
        async for part in parts:
            yield _unpack(part)
    else:
        for part in parts:
            yield _unpack(part)
            await asyncio.sleep(0)  # let acks in between parts of a plain list


def _unpack(part) -> Part:
    try:
        layer_start, layer_end, tensor = part
    except (TypeError, ValueError):
        raise TransferFailed(BAD_INPUT, f"a part must be (layer_start, layer_end, tensor), got {type(part).__name__}") from None
    return layer_start, layer_end, tensor


def _endpoint_key(ticket: TransferTicket) -> tuple[str, int]:
    return ticket.endpoint.host, ticket.endpoint.port


def _remote_failure(reason, detail) -> TransferFailed:
    reason = reason if reason in REASONS else PROTOCOL
    return TransferFailed(reason, f"the receiver failed the transfer: {str(detail)[:500]}")
