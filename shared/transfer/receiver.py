"""`KVReceiver`: the decode side of the side channel. One per process, on its asyncio loop.

The service calls `expect` for each transfer it wants (getting a ticket to send
to the prefill worker over NATS), then `wait`s for it. A sender connects to
the receiver's TCP port and runs transfers over the connection one after
another (it keeps the connection for the next one, saving a connect and a
round trip):

    receiver -> {v, nonce: nonce_r, host_id}                                once per connection
    sender   -> {v, transfer_id, nonce: nonce_s, backend, [layers: [start, end]],
                 mac: HMAC-SHA256(token, sender|nonce_r|nonce_s|transfer_id)}  per transfer
    receiver -> {status: "ready", mac: HMAC-SHA256(token, receiver|...), max_part_bytes}
             |  {status: "finished", outcome, detail, mac}   an earlier connection already ended it
             |  {status: "rejected"}, then close             unknown transfer or wrong mac
    sender   -> {op: "part", seq, layer_start, layer_end, dtype, shape, nbytes, alg, sum
                 [, shm, offset]}  [+ nbytes raw payload bytes when tcp]      as parts come
             |  {op: "part", seq, layer_start, layer_end, dtype, shape, nbytes, shm, offset,
                 source_shape, block_dim, block_runs, lease}   blocks read in place from the sender's region
    receiver -> {op: "ack", seq}  once on_part returned  |  {op: "error", reason, detail}, then close
    sender   -> {op: "end", parts}               receiver -> {op: "done"}
    sender   -> {op: "abort", detail}            its part producer failed

A sender claims the layers it will deliver (all of them by default); several
senders may deliver one transfer between them, each its own layers, as the
stages of a pipelined prefill pool do. A wrong or unknown token closes the connection and is counted in
`stats.unauthenticated`; the expectation itself is untouched, so a stranger
cannot fail someone else's transfer. Once authenticated, anything wrong on the
connection (a corrupted payload, a malformed frame, the connection dropping)
fails the transfer at once, so the decode worker can fall back to a local
prefill without waiting for the deadline. A second authenticated connection
claiming layers another one claimed (a redelivered prefill job) replaces it,
and those layers start over. Every expectation ends by its deadline at the latest:
a timer fails it and closes its connection.
"""

import asyncio
import inspect
import math
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from contracts import TransferEndpoint, TransferTicket
from shared.engine.block_slice import BlockSlice
from shared.telemetry.logging import get_logger
from shared.transfer import checksum as checksums
from shared.transfer.shm import MappingCache, host_id, shm_available, sweep_orphan_segments
from shared.transfer.types import (
    BACKENDS,
    CANCELLED,
    CONNECTION,
    CORRUPTED,
    DEADLINE,
    INCOMPLETE,
    ON_PART_ERROR,
    PROTOCOL,
    SENDER_ABORTED,
    SHM_ERROR,
    SOURCE_RELEASED,
    STOPPED,
    TOO_LARGE,
    TransferFailed,
    TransferResult,
    TransferStats,
)
from shared.transfer.tls import TLSChannel, TransferTLS
from shared.transfer.wire import (
    DTYPES,
    MAC_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Channel,
    configure_socket,
    has_unread,
    receiver_proof,
    sender_proof,
)

log = get_logger(__name__)

OnPart = Callable[[int, int, "torch.Tensor | BlockSlice"], None]

_MAX_DIMS = 8
_MAX_TRANSFER_ID = 256
_MAX_RUNS = 4096  # block runs in one part's header
_MAX_BLOCKS_PER_PART = 1 << 20  # blocks one region part may name


@dataclass(eq=False)
class _Expectation:
    transfer_id: str
    token: bytes
    on_part: OnPart
    layer_start: int
    layer_end: int
    deadline_unix_s: float
    done: asyncio.Future
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when a sender authenticated
    backend: str = "none"
    num_bytes: int = 0
    received: set[int] = field(default_factory=set)  # absolute layer indices applied
    connections: dict = field(default_factory=dict)  # live connection task -> the layers [start, end) it claimed
    timer: asyncio.TimerHandle | None = None

    @property
    def complete(self) -> bool:
        return len(self.received) == self.layer_end - self.layer_start

    def missing_in(self, claim: tuple[int, int]) -> int:
        return sum(1 for layer in range(*claim) if layer not in self.received)

    def elapsed(self) -> float:
        return time.perf_counter() - (self.started if self.started is not None else self.created)


class _BufferPool:
    """Receive buffers for `tcp` payloads: reused across connections, all of them together at most `cap` bytes,
    of which at most `idle_cap` are kept while unused."""

    def __init__(self, cap: int, idle_cap: int):
        self.cap = cap
        self.idle_cap = idle_cap
        self.in_use = 0
        self._free: list[torch.Tensor] = []  # least recently released first
        self._waiters: list[asyncio.Future] = []

    @property
    def free_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    async def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` (`nbytes` <= cap), waiting while others hold too much."""
        while self.in_use + nbytes > self.cap:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        best = None
        for i, buf in enumerate(self._free):  # tensors compare elementwise: pick by index
            if buf.numel() >= nbytes and (best is None or buf.numel() < self._free[best].numel()):
                best = i
        if best is not None:
            best = self._free.pop(best)
        else:
            while self._free and self.in_use + self.free_bytes + nbytes > self.cap:
                self._free.pop(0)
            best = torch.empty(nbytes, dtype=torch.uint8)
        self.in_use += best.numel()
        return best

    def release(self, buf: torch.Tensor) -> None:
        self.in_use -= buf.numel()
        self._free.append(buf)
        while self.free_bytes > self.idle_cap:
            self._free.pop(0)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def clear(self) -> None:
        self._free.clear()


class KVReceiver:
    """Receives KV tensors for expected transfers; see the module docstring for the protocol.

    Limits: `max_part_bytes` (one part), `max_buffer_bytes` (all tcp receive
    buffers together; a connection waits for room), `idle_buffer_bytes` (of
    which kept for reuse while unused), `shm_cache_bytes` (mappings of senders'
    pool segments kept for reuse), `region_cache_bytes` (mappings of senders'
    shared regions, their KV caches: address space, not memory), `max_connections` (senders' connections,
    once authenticated), `max_handshakes` (connections not yet authenticated: past it, the oldest that has
    sent nothing unread makes room, so a flood of silent connections never locks real senders out),
    `handshake_timeout_s` (a new connection must authenticate within it), `idle_connection_s` (a
    sender's connection is kept this long between its transfers),
    `io_timeout_s` (a read or write that waits must make progress within
    it), `finished_memory` (ended transfers remembered, to answer a late
    duplicate sender). With `tls` (`shared.transfer.tls`) every connection must speak TLS, its
    handshake within `handshake_timeout_s`.
    """

    def __init__(
        self,
        *,
        max_part_bytes: int = 256 << 20,
        max_buffer_bytes: int = 512 << 20,
        idle_buffer_bytes: int = 64 << 20,
        shm_cache_bytes: int = 1 << 30,
        region_cache_bytes: int = 1 << 40,
        max_connections: int = 256,
        max_handshakes: int = 64,
        handshake_timeout_s: float = 2.0,
        idle_connection_s: float = 60.0,
        io_timeout_s: float = 10.0,
        finished_memory: int = 4096,
        tls: TransferTLS | None = None,
    ):
        if max_part_bytes > max_buffer_bytes:
            raise ValueError("max_part_bytes must not exceed max_buffer_bytes")
        self.max_part_bytes = max_part_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.idle_buffer_bytes = idle_buffer_bytes
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_connection_s = idle_connection_s
        self.io_timeout_s = io_timeout_s
        self.finished_memory = finished_memory
        self.tls = tls
        self.stats = TransferStats()
        self.host_id = host_id()
        self.endpoint: TransferEndpoint | None = None
        self._shm_cache = MappingCache(shm_cache_bytes)
        self._region_cache = MappingCache(region_cache_bytes)
        self._buffers: _BufferPool | None = None
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._sweep_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self._handshaking: OrderedDict[asyncio.Task, socket.socket] = OrderedDict()  # oldest first
        self._active: dict[str, _Expectation] = {}
        self._finished: OrderedDict[str, tuple[bytes, TransferResult]] = OrderedDict()
        self._last_shm_check = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None) -> None:
        """Listen on `host:port` (port 0: any free port). Tickets name `advertise_host`, default `host`."""
        if self._listener is not None:
            raise RuntimeError("receiver already started")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(1024)  # a burst of connections waits for accept rather than having its SYNs dropped
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        bound_port = listener.getsockname()[1]
        if advertise_host is None:
            if host in ("0.0.0.0", "::", ""):
                raise ValueError(f"listening on {host!r} needs advertise_host: the address senders should dial")
            advertise_host = host
        self.endpoint = TransferEndpoint(host=advertise_host, port=bound_port, host_id=self.host_id,
                                         tls=self.tls is not None)
        self._buffers = _BufferPool(self.max_buffer_bytes, self.idle_buffer_bytes)
        sweep_orphan_segments()
        self._accept_task = asyncio.create_task(self._accept_loop(), name="kv-receiver-accept")
        self._sweep_task = asyncio.create_task(self._let_go_of_unlinked(), name="kv-receiver-unmap")
        log.info("kv receiver listening", host=host, port=bound_port, advertise_host=advertise_host,
                 shm=shm_available(), tls=self.tls is not None)

    async def stop(self) -> None:
        """Stop listening, fail every pending transfer (`stopped`), close every connection."""
        for exp in list(self._active.values()):
            self._finish(exp, failure=TransferFailed(STOPPED, "the receiver stopped"))
        tasks = [t for t in (self._accept_task, self._sweep_task, *self._connections) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._accept_task = None
        self._sweep_task = None
        self.endpoint = None
        self._shm_cache.close()
        self._region_cache.close()
        if self._buffers is not None:
            self._buffers.clear()

    # -- the API the decode worker uses ------------------------------------------------------------------

    def expect(self, transfer_id: str, *, on_part: OnPart, total_layers: tuple[int, int],
               deadline_s: float) -> TransferTicket:
        """Register a transfer of layers `[total_layers[0], total_layers[1])` due within `deadline_s` seconds.

        `on_part(layer_start, layer_end, tensor)` is called on this loop for each
        part as it arrives, in any order; `tensor` (shape `[layer_end - layer_start, ...]`)
        is a view over the receive buffer or the sender's segment, valid only during
        the call: copy it. It is a `BlockSlice` when the sender sent blocks of its
        shared-memory cache: copy them with `copy_into` (one pass, straight into the
        destination). Such a part is checked after `on_part` too (the sender must
        still hold its blocks, see `shm.LeaseTable`): when the transfer then fails,
        what `on_part` wrote is garbage. If it raises, the transfer fails (`on-part-error`).
        """
        if self.endpoint is None:
            raise RuntimeError("start the receiver before expecting transfers")
        if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= _MAX_TRANSFER_ID:
            raise ValueError(f"transfer_id must be a string of 1..{_MAX_TRANSFER_ID} characters")
        if transfer_id in self._active:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        start, end = total_layers
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
            raise ValueError(f"total_layers must be (start, end) with 0 <= start < end, got {total_layers!r}")
        if not (isinstance(deadline_s, (int, float)) and math.isfinite(deadline_s) and deadline_s > 0):
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        if not callable(on_part):
            raise ValueError("on_part must be callable")
        loop = asyncio.get_running_loop()
        self._finished.pop(transfer_id, None)
        exp = _Expectation(transfer_id, secrets.token_bytes(32), on_part, start, end,
                           time.time() + deadline_s, loop.create_future())
        exp.timer = loop.call_at(loop.time() + deadline_s, self._on_deadline, exp)
        self._active[transfer_id] = exp
        return TransferTicket(transfer_id=transfer_id, token=exp.token, endpoint=self.endpoint,
                              deadline_unix_s=exp.deadline_unix_s)

    async def wait(self, transfer_id: str) -> TransferResult:
        """The outcome of an expected transfer: ok once every layer arrived, else the failure. Ends by the deadline."""
        exp = self._active.get(transfer_id)
        if exp is not None:
            return await asyncio.shield(exp.done)
        if transfer_id in self._finished:
            return self._finished[transfer_id][1]
        raise KeyError(f"no transfer {transfer_id!r} is expected or recently finished")

    def cancel(self, transfer_id: str) -> None:
        """Drop the expectation: its `wait` returns `cancelled`, its connection closes, late parts are discarded."""
        exp = self._active.get(transfer_id)
        if exp is not None:
            self._finish(exp, failure=TransferFailed(CANCELLED, "the receiver cancelled the transfer"))

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- bookkeeping -----------------------------------------------------------------------------------

    def _on_deadline(self, exp: _Expectation) -> None:
        if self._active.get(exp.transfer_id) is exp:
            self._finish(exp, failure=TransferFailed(DEADLINE, "the transfer's deadline passed"))

    def _finish(self, exp: _Expectation, *, failure: TransferFailed | None = None) -> None:
        """End `exp` once: settle `wait`, remember the outcome, close its connection unless we run in it."""
        if self._active.get(exp.transfer_id) is not exp:
            return
        del self._active[exp.transfer_id]
        if exp.timer is not None:
            exp.timer.cancel()
        if failure is None:
            result = TransferResult(True, None, exp.backend, exp.num_bytes, exp.elapsed())
        else:
            result = TransferResult.failed(failure, exp.backend, exp.num_bytes, exp.elapsed())
            log.info("kv transfer failed", transfer_id=exp.transfer_id, reason=failure.reason, error=str(failure),
                     backend=exp.backend, received_layers=len(exp.received))
        self.stats.record(result)
        self._finished[exp.transfer_id] = (exp.token, result)
        while len(self._finished) > self.finished_memory:
            self._finished.popitem(last=False)
        if not exp.done.done():
            exp.done.set_result(result)
        if failure is not None:
            for conn in exp.connections:
                if not conn.done() and conn is not asyncio.current_task():
                    conn.cancel()

    # -- connections -----------------------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                log.warning("kv receiver accept failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            if len(self._connections) - len(self._handshaking) >= self.max_connections:
                self.stats.refused_connections += 1
                sock.close()
                continue
            if len(self._handshaking) >= self.max_handshakes:
                self._evict_a_handshake()
            self.stats.connections += 1
            try:
                configure_socket(sock)
                if self.tls is not None:
                    sock = self.tls.server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except OSError:  # reset while it waited to be accepted (ssl.SSLError is an OSError too)
                self.stats.unauthenticated += 1
                sock.close()
                continue
            task = asyncio.create_task(self._serve(sock), name="kv-receiver-connection")
            self._connections.add(task)
            self._handshaking[task] = sock
            task.add_done_callback(self._forget_connection)

    def _forget_connection(self, task: asyncio.Task) -> None:
        self._connections.discard(task)
        self._handshaking.pop(task, None)

    def _evict_a_handshake(self) -> None:
        """Close the oldest unauthenticated connection with nothing waiting to be read (a sender whose auth
        has arrived is never the one closed), or the oldest of all if every one has."""
        victim = next((task for task, sock in self._handshaking.items() if not has_unread(sock)),
                      next(iter(self._handshaking)))
        self._handshaking.pop(victim)
        victim.cancel()
        self.stats.evicted_handshakes += 1

    async def _serve(self, sock: socket.socket) -> None:
        """One connection: a hello, then transfers one after another until the sender leaves or one fails."""
        channel = TLSChannel(sock, self.io_timeout_s) if self.tls is not None else Channel(sock, self.io_timeout_s)
        receiver_nonce = secrets.token_bytes(NONCE_BYTES)
        exp = None
        try:
            first = True
            while True:
                exp = None
                # A new connection must authenticate promptly; a kept one may idle between transfers.
                try:
                    async with asyncio.timeout(self.handshake_timeout_s if first else self.idle_connection_s):
                        if first:
                            if self.tls is not None:
                                await channel.handshake()
                            await channel.send_msg({"v": PROTOCOL_VERSION, "nonce": receiver_nonce,
                                                    "host_id": self.host_id})
                        auth = await channel.recv_msg(idle_ok=True)
                except (TransferFailed, TimeoutError):
                    if first:
                        self.stats.unauthenticated += 1
                    return
                self._handshaking.pop(asyncio.current_task(), None)  # it spoke: no longer evictable
                first = False
                exp, backend, keep, claim = await self._authenticate(channel, auth, receiver_nonce)
                if exp is None:
                    if keep:
                        continue
                    return
                try:
                    await self._receive(channel, exp, backend, claim)
                finally:
                    exp.connections.pop(asyncio.current_task(), None)
        except TransferFailed as failure:
            if exp is not None:
                channel.try_send_msg({"op": "error", "reason": failure.reason, "detail": str(failure)})
                self._finish(exp, failure=failure)
        except asyncio.CancelledError:
            # Cancelled by `_finish` (deadline, cancel, a newer connection) or `stop`: say why, if we can.
            if exp is not None and exp.transfer_id in self._finished:
                result = self._finished[exp.transfer_id][1]
                if not result.ok:
                    channel.try_send_msg({"op": "error", "reason": result.reason, "detail": result.error})
        except Exception as exc:  # a bug here must not take the receiver down; it fails this transfer
            log.exception("kv receiver connection crashed")
            if exp is not None:
                self._finish(exp, failure=TransferFailed(PROTOCOL, f"receiver error: {exc!r}"))
        finally:
            channel.close()

    async def _authenticate(self, channel: Channel, auth: dict,
                            receiver_nonce: bytes) -> tuple[_Expectation | None, str, bool, tuple[int, int]]:
        """Check a sender's claim to a transfer. Returns (expectation, backend, keep the connection, the layers
        this connection will send)."""
        transfer_id, mac, sender_nonce, backend = (
            auth.get("transfer_id"), auth.get("mac"), auth.get("nonce"), auth.get("backend"))
        well_formed = (
            auth.get("v") == PROTOCOL_VERSION and isinstance(transfer_id, str)
            and 0 < len(transfer_id) <= _MAX_TRANSFER_ID and isinstance(mac, bytes) and len(mac) == MAC_BYTES
            and isinstance(sender_nonce, bytes) and len(sender_nonce) == NONCE_BYTES and backend in BACKENDS
        )
        exp = self._active.get(transfer_id) if well_formed else None
        finished = self._finished.get(transfer_id) if well_formed and exp is None else None
        token = exp.token if exp is not None else finished[0] if finished is not None else None
        if token is None or not secrets.compare_digest(
            mac, sender_proof(token, transfer_id, receiver_nonce, sender_nonce)
        ):
            self.stats.unauthenticated += 1
            channel.try_send_msg({"status": "rejected"})
            return None, "", False, (0, 0)
        proof = receiver_proof(token, transfer_id, receiver_nonce, sender_nonce)
        if exp is None:
            result = finished[1]
            await channel.send_msg({"status": "finished", "outcome": "ok" if result.ok else result.reason,
                                    "detail": result.error, "mac": proof})
            return None, "", True, (0, 0)
        if backend == "shm" and not shm_available():
            await channel.send_msg({"status": "unsupported-backend", "detail": "no /dev/shm here", "mac": proof})
            return None, "", True, (0, 0)
        claim = auth.get("layers", [exp.layer_start, exp.layer_end])
        if (not isinstance(claim, list) or len(claim) != 2 or not all(type(v) is int for v in claim)
                or not exp.layer_start <= claim[0] < claim[1] <= exp.layer_end):
            await channel.send_msg({"status": "bad-claim", "mac": proof,
                                    "detail": f"layers {str(claim)[:60]} are not within [{exp.layer_start}, "
                                              f"{exp.layer_end})"})
            return None, "", True, (0, 0)
        claim = (claim[0], claim[1])
        # Several senders may each deliver some of the layers (a pipelined prefill pool: one per stage). A
        # newer sender for layers another one claimed (a redelivered job) replaces it: those layers start over.
        for conn, other in list(exp.connections.items()):
            if other[0] < claim[1] and claim[0] < other[1] and not conn.done():
                conn.cancel()
                log.info("kv transfer restarted by a new connection", transfer_id=transfer_id, layers=list(other))
        exp.received.difference_update(range(*claim))
        if claim == (exp.layer_start, exp.layer_end):
            exp.num_bytes = 0
        exp.connections[asyncio.current_task()] = claim
        exp.backend = backend
        if exp.started is None:
            exp.started = time.perf_counter()
        await channel.send_msg({"status": "ready", "mac": proof, "max_part_bytes": self.max_part_bytes})
        return exp, backend, True, claim

    async def _receive(self, channel: Channel, exp: _Expectation, backend: str, claim: tuple[int, int]) -> None:
        shm_names: set[str] = set()
        buffer = None
        try:
            while True:
                # Between parts the sender may be computing the next layer: only the deadline bounds
                # that wait. After the last part, the closing "end" must come promptly.
                msg = await channel.recv_msg(idle_ok=exp.missing_in(claim) > 0)
                if self._active.get(exp.transfer_id) is not exp and not exp.complete:
                    self.stats.discarded_parts += 1
                    return  # ended meanwhile (cancelled, deadline): late parts are not applied
                op = msg.get("op")
                if op == "part":
                    header = _check_part(msg, exp, claim, backend, self.max_part_bytes)
                    if backend == "tcp":
                        if buffer is None or buffer.numel() < header.nbytes:
                            if buffer is not None:
                                self._buffers.release(buffer)
                                buffer = None
                            buffer = await self._buffers.acquire(header.nbytes)
                        payload = buffer[: header.nbytes]
                        await channel.recv_payload(memoryview(payload.numpy()))
                    elif header.block_ids is not None:
                        payload = self._map_region(header)
                    else:
                        payload = self._map_shm(header, shm_names)
                    if self._active.get(exp.transfer_id) is not exp:
                        self.stats.discarded_parts += 1
                        return
                    self._apply(exp, header, payload)
                    del payload
                    await channel.send_msg({"op": "ack", "seq": header.seq})
                    if exp.complete:
                        self._finish(exp)
                elif op == "end":
                    missing = exp.missing_in(claim)
                    if missing:
                        raise TransferFailed(INCOMPLETE, f"the sender ended the transfer with {missing} layers missing")
                    await channel.send_msg({"op": "done"})
                    return
                elif op == "abort":
                    detail = msg.get("detail")
                    raise TransferFailed(SENDER_ABORTED, f"the sender gave up: {str(detail)[:500]}")
                else:
                    raise TransferFailed(PROTOCOL, f"unexpected message op {str(op)[:40]!r}")
        except TransferFailed as failure:
            if failure.reason == CONNECTION and not exp.missing_in(claim):
                return  # the sender went away after its last part; nothing is lost
            for name in shm_names:  # the sender unlinks them on failure; let go of the memory now
                self._shm_cache.drop(name)
            raise
        finally:
            if buffer is not None:
                self._buffers.release(buffer)
            self._shm_cache.trim()

    async def _let_go_of_unlinked(self) -> None:
        """Unmap the segments and regions their senders unlinked (a stopped or killed prefill worker's cache),
        also while no transfer comes to do it."""
        while True:
            await asyncio.sleep(5.0)
            self._drop_unlinked_now_and_then()

    def _drop_unlinked_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._last_shm_check > 5.0:
            self._last_shm_check = now
            self._shm_cache.drop_unlinked()
            self._region_cache.drop_unlinked()

    def _map_region(self, header: "_PartHeader") -> BlockSlice:
        """The part's blocks, in place in the sender's shared region."""
        self._drop_unlinked_now_and_then()
        try:
            seg = self._region_cache.get(header.shm)
        except (OSError, ValueError) as exc:
            raise TransferFailed(SHM_ERROR, f"cannot map shared-memory region {header.shm!r}: {exc}") from None
        source_bytes = math.prod(header.source_shape) * header.dtype.itemsize
        if header.offset + source_bytes > seg.size:
            raise TransferFailed(PROTOCOL, f"a source of {source_bytes} bytes at {header.offset} overruns its "
                                           f"{seg.size}-byte region")
        source = seg.bytes[header.offset : header.offset + source_bytes].view(header.dtype).view(header.source_shape)
        lease_name, lease_offset, _ = header.lease
        try:
            lease_seg = self._region_cache.get(lease_name)
        except (OSError, ValueError) as exc:
            raise TransferFailed(SHM_ERROR, f"cannot map the sender's lease table {lease_name!r}: {exc}") from None
        if lease_offset + 8 > lease_seg.size:
            raise TransferFailed(PROTOCOL, f"a lease at {lease_offset} is outside its {lease_seg.size}-byte table")
        header.lease_slot = lease_seg.bytes[lease_offset : lease_offset + 8].view(torch.int64)
        return BlockSlice(source, header.block_ids, header.block_dim)

    def _map_shm(self, header: "_PartHeader", names: set[str]) -> torch.Tensor:
        self._drop_unlinked_now_and_then()
        try:
            seg = self._shm_cache.get(header.shm)
        except (OSError, ValueError) as exc:
            raise TransferFailed(SHM_ERROR, f"cannot map shared-memory segment {header.shm!r}: {exc}") from None
        names.add(header.shm)
        if header.offset + header.nbytes > seg.size:
            raise TransferFailed(PROTOCOL, f"part of {header.nbytes} bytes at {header.offset} overruns its "
                                           f"{seg.size}-byte segment")
        return seg.bytes[header.offset : header.offset + header.nbytes]

    def _apply(self, exp: _Expectation, header: "_PartHeader", payload: "torch.Tensor | BlockSlice") -> None:
        if isinstance(payload, BlockSlice):
            self._check_lease(header)
            tensor = payload
        else:
            self._verify(header, payload)
            tensor = payload.view(header.dtype).view(header.shape)
        try:
            returned = exp.on_part(header.layer_start, header.layer_end, tensor)
            if inspect.isawaitable(returned):
                if inspect.iscoroutine(returned):
                    returned.close()
                raise TypeError("on_part must be a plain function, not a coroutine function")
        except Exception as exc:
            raise TransferFailed(ON_PART_ERROR, f"on_part failed for layers [{header.layer_start}, "
                                                f"{header.layer_end}): {exc!r}") from None
        finally:
            del tensor
        if isinstance(payload, BlockSlice):
            self._check_lease(header)  # still held after the copy: the blocks were held throughout it
            self.stats.in_place_parts += 1
        exp.received.update(range(header.layer_start, header.layer_end))
        exp.num_bytes += header.nbytes
        self.stats.bytes_by_backend[exp.backend] += header.nbytes


    @staticmethod
    def _check_lease(header: "_PartHeader") -> None:
        if int(header.lease_slot[0]) != header.lease[2]:
            raise TransferFailed(SOURCE_RELEASED, f"the sender let go of layers [{header.layer_start}, "
                                                  f"{header.layer_end}) while they were being read")

    def _verify(self, header: "_PartHeader", payload: torch.Tensor) -> None:
        if checksums.checksum(header.alg, payload) != header.sum:
            self.stats.corrupted_parts += 1
            raise TransferFailed(CORRUPTED, f"layers [{header.layer_start}, {header.layer_end}) failed their "
                                            f"{header.alg} checksum")


@dataclass(slots=True)
class _PartHeader:
    seq: int
    layer_start: int
    layer_end: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    alg: str
    sum: int
    shm: str | None
    offset: int
    source_shape: tuple[int, ...] | None = None  # blocks of a shared region: the region tensor's shape,
    block_dim: int = 0  # the dimension the blocks are on,
    block_ids: tuple[int, ...] | None = None  # and which of them, in order,
    lease: tuple[str, int, int] | None = None  # guarded by this lease (region, byte offset, generation)
    lease_slot: torch.Tensor | None = None  # the lease's slot, once mapped


def _check_part(msg: dict, exp: _Expectation, claim: tuple[int, int], backend: str, max_part_bytes: int) -> _PartHeader:
    """Validate a part header against the expectation; raises TransferFailed(PROTOCOL / TOO_LARGE)."""

    def bad(what: str) -> TransferFailed:
        return TransferFailed(PROTOCOL, f"bad part header: {what}")

    def integer(key: str, lo: int = 0, hi: int = 1 << 62) -> int:
        value = msg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise bad(f"{key} must be an integer in [{lo}, {hi}]")
        return value

    seq = integer("seq")
    layer_start, layer_end = integer("layer_start"), integer("layer_end")
    if not claim[0] <= layer_start < layer_end <= claim[1]:
        raise bad(f"layers [{layer_start}, {layer_end}) are not within the expected "
                  f"[{claim[0]}, {claim[1]})")
    if any(layer in exp.received for layer in range(layer_start, layer_end)):
        raise bad(f"layers [{layer_start}, {layer_end}) overlap layers already received")
    dtype = DTYPES.get(msg.get("dtype"))
    if dtype is None:
        raise bad(f"dtype {str(msg.get('dtype'))[:40]!r} is not one of {', '.join(DTYPES)}")
    shape = msg.get("shape")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= _MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)):
        raise bad("shape must be a list of 1..8 non-negative integers")
    if shape[0] != layer_end - layer_start:
        raise bad(f"shape {shape} does not start with the {layer_end - layer_start} layers it claims")
    nbytes = integer("nbytes")
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise bad(f"nbytes {nbytes} is not the size of {msg.get('dtype')} {shape}")
    if nbytes > max_part_bytes:
        raise TransferFailed(TOO_LARGE, f"a part of {nbytes} bytes; this receiver takes at most {max_part_bytes}")
    in_place = backend == "shm" and "block_runs" in msg  # read in place, guarded by a lease, not a checksum
    alg, total = "", 0
    if not in_place:
        alg = msg.get("alg")
        if alg not in checksums.ALGORITHMS:
            raise bad(f"checksum algorithm {str(alg)[:40]!r} is not one of {', '.join(checksums.ALGORITHMS)}")
        total = integer("sum", 0, (1 << 64) - 1)
    shm, offset = None, 0
    if backend == "shm":
        shm = msg.get("shm")
        if not isinstance(shm, str):
            raise bad("an shm part must name its segment")
        offset = integer("offset")
        if in_place:
            return _region_part(msg, bad, _PartHeader(seq, layer_start, layer_end, dtype, tuple(shape), nbytes, alg,
                                                      total, shm, offset))
        if offset % 64:
            raise bad("an shm part's offset must be a multiple of 64")
    return _PartHeader(seq, layer_start, layer_end, dtype, tuple(shape), nbytes, alg, total, shm, offset)


def _region_part(msg: dict, bad, header: _PartHeader) -> _PartHeader:
    """Complete the header of a part sent as blocks of the sender's shared region."""
    source_shape, block_dim, runs = msg.get("source_shape"), msg.get("block_dim"), msg.get("block_runs")
    if (not isinstance(source_shape, list) or len(source_shape) != len(header.shape)
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in source_shape)):
        raise bad("source_shape must be a list of non-negative integers as long as shape")
    if not isinstance(block_dim, int) or isinstance(block_dim, bool) or not 1 <= block_dim < len(source_shape):
        raise bad("block_dim must name a dimension after the layers")
    if not isinstance(runs, list) or len(runs) > _MAX_RUNS:
        raise bad(f"block_runs must be a list of at most {_MAX_RUNS} runs")
    if 0 in source_shape or 0 in header.shape:
        raise bad("a region part has no empty dimension")
    num_blocks = source_shape[block_dim]
    total = 0
    for run in runs:
        if (not isinstance(run, list) or len(run) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in run)
                or not (0 <= run[0] and 0 < run[1] and run[0] + run[1] <= num_blocks)):
            raise bad(f"each block run must be [first, count] within the source's {num_blocks} blocks")
        total += run[1]
    # Checked before a single id is made: the part's size (within max_part_bytes) bounds the blocks it names.
    expected = list(source_shape)
    expected[block_dim] = total
    if tuple(expected) != header.shape:
        raise bad(f"shape {list(header.shape)} is not {total} blocks of a source of shape {source_shape}")
    if total > _MAX_BLOCKS_PER_PART:
        raise bad(f"a part of {total} blocks; at most {_MAX_BLOCKS_PER_PART}")
    block_ids = [block for first, count in runs for block in range(first, first + count)]
    if header.offset % header.dtype.itemsize:
        raise bad("a region part's offset must be a multiple of its element size")
    lease = msg.get("lease")
    if (not isinstance(lease, list) or len(lease) != 3 or not isinstance(lease[0], str)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in lease[1:])
            or lease[1] < 0 or lease[1] % 8 or not 0 < lease[2] < 1 << 63):
        raise bad("a region part needs a lease [region, 8-aligned offset, generation > 0]")
    header.lease = (lease[0], lease[1], lease[2])
    header.source_shape = tuple(source_shape)
    header.block_dim = block_dim
    header.block_ids = tuple(block_ids)
    return header
