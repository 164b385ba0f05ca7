"""The side channel's wire: framed msgpack control messages and raw payloads over one TCP connection.

A control message is a 4-byte big-endian length then a msgpack map (at most
`MAX_MESSAGE_BYTES`). A `tcp` part's payload follows its header message as raw
bytes. Reads and writes go through the event loop's `sock_*` calls on a
non-blocking socket, so a payload is received straight into the caller's
buffer (only what arrived together with its header, at most 128 KiB, passes
through the message buffer) and sent straight from the tensor's memory.

Time bounds: the caller runs the whole conversation under the transfer's
deadline; on top of that, every read or write that has to wait must make
progress within `io_timeout_s` (else `TransferFailed(STALLED)`). Waiting for the
*start* of the next message is bounded by the deadline only, because a sender
may legitimately pause between layers while its model computes the next one.
"""

import asyncio
import hashlib
import hmac
import select
import socket
import ssl
import struct

import msgpack
import torch

from shared.transfer.types import CONNECTION, PROTOCOL, STALLED, TransferFailed

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
PAYLOAD_CHUNK_BYTES = 1 << 20  # one timed read/write step of a payload
NONCE_BYTES = 32
MAC_BYTES = 32
_LENGTH = struct.Struct("!I")

# The dtypes a part may have, by their wire names (what KV caches are stored in, and plain integers).
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64",
                 "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
_DOMAIN = b"splitserve-kv-transfer/1"


def sender_proof(token: bytes, transfer_id: str, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    """HMAC-SHA256 proving the sender knows `token`, bound to this connection's two nonces."""
    return _proof(b"sender", token, transfer_id, receiver_nonce, sender_nonce)


def receiver_proof(token: bytes, transfer_id: str, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    """HMAC-SHA256 proving the receiver knows `token` (so a sender never streams KV to an impostor)."""
    return _proof(b"receiver", token, transfer_id, receiver_nonce, sender_nonce)


def _proof(role: bytes, token: bytes, transfer_id: str, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    # Fixed-length fields first, the one variable-length field last: no two inputs encode alike.
    message = b"|".join((_DOMAIN, role, receiver_nonce, sender_nonce, transfer_id.encode()))
    return hmac.new(token, message, hashlib.sha256).digest()


def configure_socket(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Headers and acks are small and latency-bound: no Nagle delay.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def has_unread(sock: socket.socket) -> bool:
    """Whether bytes (or the peer's close) wait on a socket, plain or TLS, without taking them."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        poller = select.poll()  # (not select(): it cannot take descriptors from 1024 on)
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True  # closed or broken: closing it loses nothing


class Channel:
    """One side-channel connection (either end), with a small read buffer and non-blocking fast paths.

    Reads and writes first try the socket directly; only when it would block do
    they wait on the event loop, each such wait bounded by `io_timeout_s`. A
    payload is read straight into the caller's buffer and written straight from
    the caller's memory.
    """

    def __init__(self, sock: socket.socket, io_timeout_s: float):
        self.sock = sock
        self.io_timeout_s = io_timeout_s
        self.loop = asyncio.get_running_loop()
        self._buf = bytearray(2 * (MAX_MESSAGE_BYTES + _LENGTH.size))
        self._view = memoryview(self._buf)
        self._start = 0  # buffered, unread bytes are _buf[_start:_end]
        self._end = 0
        self.closed = False
        # Kept by a sender that reuses the connection for several transfers.
        self.receiver_nonce: bytes | None = None
        self.last_used = 0.0

    # -- writing ---------------------------------------------------------------------------------------

    async def send_msg(self, msg: dict) -> None:
        await self._send_all(_frame(msg), "sending a message")

    async def send_payload(self, data: memoryview) -> None:
        """Send `data` (a byte view over the caller's memory) without copying it."""
        await self._send_all(data, "sending a payload")

    def try_send_msg(self, msg: dict) -> None:
        """Best effort, never blocks: used to say why just before closing."""
        if self.closed:
            return
        try:
            self.sock.send(_frame(msg))
        except OSError:
            pass

    async def _send_all(self, data, what: str) -> None:
        view = memoryview(data)
        try:
            sent = self.sock.send(view)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            raise TransferFailed(CONNECTION, f"connection failed while {what}: {exc}") from None
        for start in range(sent, len(view), PAYLOAD_CHUNK_BYTES):
            await self._timed(self.loop.sock_sendall(self.sock, view[start : start + PAYLOAD_CHUNK_BYTES]), what)

    # -- reading ---------------------------------------------------------------------------------------

    async def recv_msg(self, *, idle_ok: bool = False) -> dict:
        """The next message; with `idle_ok`, its first byte may take as long as the caller's deadline allows."""
        await self._fill(_LENGTH.size, idle_ok)
        (length,) = _LENGTH.unpack_from(self._buf, self._start)
        if length > MAX_MESSAGE_BYTES:
            raise TransferFailed(PROTOCOL, f"a control message of {length} bytes (at most {MAX_MESSAGE_BYTES})")
        await self._fill(_LENGTH.size + length, False)
        body = self._view[self._start + _LENGTH.size : self._start + _LENGTH.size + length]
        self._consume(_LENGTH.size + length)
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES)
        except Exception as exc:  # msgpack raises several types for malformed input
            raise TransferFailed(PROTOCOL, f"a control message that is not msgpack ({type(exc).__name__})") from None
        finally:
            body.release()
        if not isinstance(msg, dict):
            raise TransferFailed(PROTOCOL, f"a control message that is a {type(msg).__name__}, not a map")
        return msg

    async def recv_payload(self, into: memoryview) -> None:
        """Fill `into` (a byte view over the caller's buffer): first from what is buffered, then from the socket."""
        got = min(len(into), self._end - self._start)
        if got:
            into[:got] = self._view[self._start : self._start + got]
            self._consume(got)
        while got < len(into):
            got += await self._recv_into(into[got:], timed=True, what="receiving a payload")

    def has_buffered(self) -> bool:
        return self._end > self._start

    def peer_closed_or_chatty(self) -> bool:
        """For an idle connection: True if the peer closed it or sent something unasked (then do not reuse it)."""
        if self.closed or self.has_buffered():
            return True
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: alive and quiet
        except OSError:
            return True
        return True  # end of stream, or bytes nobody asked for

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def _consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    async def _fill(self, need: int, idle_ok: bool) -> None:
        if self._end - self._start >= need:
            return
        if len(self._buf) - self._start < need:  # not enough room after the unread bytes: move them to the front
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        timed = not (idle_ok and self._end == self._start)  # only the very first byte may wait untimed
        while self._end - self._start < need:
            self._end += await self._recv_into(self._view[self._end :], timed=timed, what="receiving a message")
            timed = True

    async def _recv_into(self, view: memoryview, *, timed: bool, what: str) -> int:
        try:
            got = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            got = None
        except OSError as exc:
            raise TransferFailed(CONNECTION, f"connection failed while {what}: {exc}") from None
        if got is None:
            waiting = self.loop.sock_recv_into(self.sock, view)
            if timed:
                got = await self._timed(waiting, what)
            else:
                try:
                    got = await waiting
                except OSError as exc:
                    raise TransferFailed(CONNECTION, f"connection failed while {what}: {exc}") from None
        if got == 0:
            raise TransferFailed(CONNECTION, "the other side closed the connection")
        return got

    async def _timed(self, awaitable, what: str):
        try:
            async with asyncio.timeout(self.io_timeout_s) as timeout:
                return await awaitable
        except TimeoutError:
            if timeout.expired():
                raise TransferFailed(STALLED, f"no progress for {self.io_timeout_s:g}s while {what}") from None
            raise
        except OSError as exc:
            raise TransferFailed(CONNECTION, f"connection failed while {what}: {exc}") from None


def _frame(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body
