"""TLS for the side channel's TCP connections, and the channel that speaks it.

A worker given `--transfer-tls-ca/--transfer-tls-cert/--transfer-tls-key` (or
`SPLITSERVE_TRANSFER_TLS_*`; `splitserve up --tls` makes them) listens with
TLS only, presenting its certificate, and dials receivers with TLS only,
verifying theirs against the CA and the ticket's host name. The per-transfer
HMAC stays as it is: TLS hides the bytes and proves the receiver's host, the
token proves who may send what. A ticket says whether its receiver wants TLS,
so a sender without TLS says so instead of failing a handshake, and a sender
with TLS never falls back to clear text. Shared memory never leaves the host;
its control messages run over the same (TLS) connection.

`TLSChannel` is `wire.Channel` over a non-blocking `ssl.SSLSocket`: the event
loop's `sock_*` calls refuse those, so it waits for the socket itself (one
registration per direction, shared by the connection's reader and writer).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from shared.bus.tls import tls_files
from shared.transfer.types import CONNECTION, TLS, TransferFailed
from shared.transfer.wire import Channel, has_unread

TRANSFER_TLS_ENV = {"ca": "SPLITSERVE_TRANSFER_TLS_CA", "cert": "SPLITSERVE_TRANSFER_TLS_CERT",
                    "key": "SPLITSERVE_TRANSFER_TLS_KEY"}
TLS_RECORD_SEND_BYTES = 256 * 1024  # one write: a few records, so a wait comes before the socket's buffer overflows


class TransferTLSError(ValueError):
    """Side-channel TLS files that are missing, unreadable or do not belong together."""


@dataclass(frozen=True)
class TransferTLS:
    """The two contexts of one worker: it serves as a receiver and dials as a sender."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def transfer_tls(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                 environ: dict | None = None) -> TransferTLS | None:
    """The worker's side-channel TLS (None when no setting is given, on the command line or in the environment)."""
    ca_file, cert_file, key_file = tls_files(ca_file, cert_file, key_file, TRANSFER_TLS_ENV, environ)
    if not (ca_file or cert_file or key_file):
        return None
    if not (ca_file and cert_file and key_file):
        raise TransferTLSError("side-channel TLS needs all three of --transfer-tls-ca, --transfer-tls-cert and "
                               "--transfer-tls-key: a worker both receives (presenting its certificate) and "
                               "sends (checking the receiver's against the CA)")
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server.load_cert_chain(cert_file, key_file)
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TransferTLSError(f"cannot use the side-channel TLS files: {exc}") from None
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_3
    return TransferTLS(server=server, client=client)


class _Readiness:
    """Futures waiting for one direction of one socket, woken together by a single event-loop registration."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, writable: bool):
        self._loop, self._fd = loop, fd
        self._add, self._remove = ((loop.add_writer, loop.remove_writer) if writable
                                   else (loop.add_reader, loop.remove_reader))
        self._waiters: list[asyncio.Future] = []

    def wait(self) -> asyncio.Future:
        if not self._waiters:
            self._add(self._fd, self._wake)
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        return waiter

    def _wake(self) -> None:
        self._remove(self._fd)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        if self._waiters:
            self._remove(self._fd)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("connection closed"))


class TLSChannel(Channel):
    """A side-channel connection over TLS: `handshake()` first (under the caller's deadline), then as `Channel`."""

    def __init__(self, sock: ssl.SSLSocket, io_timeout_s: float):
        super().__init__(sock, io_timeout_s)
        fd = sock.fileno()
        self._readable = _Readiness(self.loop, fd, writable=False)
        self._writable = _Readiness(self.loop, fd, writable=True)

    async def handshake(self) -> None:
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._timed(self._readable.wait(), "in the TLS handshake")
            except ssl.SSLWantWriteError:
                await self._timed(self._writable.wait(), "in the TLS handshake")
            except ssl.SSLError as exc:
                raise TransferFailed(TLS, f"the TLS handshake failed: {_reason(exc)}") from None
            except OSError as exc:
                raise TransferFailed(CONNECTION, f"connection failed in the TLS handshake: {exc}") from None

    async def _send_all(self, data, what: str) -> None:
        view = memoryview(data).cast("B")
        start = 0
        while start < len(view):
            try:
                start += self.sock.send(view[start : start + TLS_RECORD_SEND_BYTES])
            except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                await self._timed(self._writable.wait(), what)
            except ssl.SSLWantReadError:
                await self._timed(self._readable.wait(), what)
            except OSError as exc:
                raise TransferFailed(CONNECTION, f"connection failed while {what}: {_reason(exc)}") from None

    async def _recv_into(self, view: memoryview, *, timed: bool, what: str) -> int:
        while True:
            try:
                got = self.sock.recv_into(view)
                break
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                waiting = self._readable.wait()
            except ssl.SSLWantWriteError:
                waiting = self._writable.wait()
            except OSError as exc:
                raise TransferFailed(CONNECTION, f"connection failed while {what}: {_reason(exc)}") from None
            if timed:
                await self._timed(waiting, what)
            else:
                try:
                    await waiting
                except OSError as exc:
                    raise TransferFailed(CONNECTION, f"connection failed while {what}: {exc}") from None
        if got == 0:
            raise TransferFailed(CONNECTION, "the other side closed the connection")
        return got

    def peer_closed_or_chatty(self) -> bool:
        if self.closed or self.has_buffered():
            return True
        if not has_unread(self.sock):
            return False  # nothing arrived: alive and quiet
        try:
            # Bytes came: TLS housekeeping (a session ticket) is taken and the socket is quiet again, else
            # the peer closed it or sent something nobody asked for.
            self.sock.recv(1)
        except ssl.SSLWantReadError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        if not self.closed:
            self._readable.close()
            self._writable.close()
        super().close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the receiver's certificate is not trusted ({exc.verify_message})"
    return str(exc) or type(exc).__name__
