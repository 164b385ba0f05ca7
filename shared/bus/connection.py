"""The NATS connection every service holds: connect, reconnect forever, drain on shutdown.

A service connects once at start (`connect` fails fast with `BusConnectionError`
when NATS is not there), then rides out NATS restarts: the client reconnects
forever, waiting `reconnect_wait_s` between attempts, and buffers what is
published meanwhile. On SIGTERM/SIGINT (`ShutdownSignal`) the service stops its
loops and calls `drain`, which lets in-flight callbacks finish, flushes what was
published, and closes, within a deadline.
"""

import asyncio
import signal
import ssl
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client

from shared.bus.credentials import BusCredentials
from shared.bus.waits import within
from shared.telemetry.logging import get_logger

log = get_logger(__name__)


PING_INTERVAL_S = 1.0


class BusConnectionError(ConnectionError):
    """The first connection to NATS could not be made."""


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    reconnect_wait_s: float = 1.0,
    credentials: BusCredentials | None = None,
    inbox_prefix: str | None = None,
    tls: ssl.SSLContext | None = None,
    tls_hostname: str | None = None,
) -> Client:
    """Connect to `url` (comma-separated for a cluster), giving up after `connect_timeout_s`.

    `credentials` prove who the service is (see `shared.bus.credentials`); `inbox_prefix` is where its replies
    arrive (a role's own, see `shared.bus.permissions.inbox_prefix`, so that no other role may read them).
    """
    auth = credentials.connect_options() if credentials is not None else {}

    async def on_disconnected() -> None:
        if not nc.is_closed:  # closing also reports a disconnect; `on_closed` says that one
            log.warning("nats disconnected; reconnecting", connection=name)

    async def on_reconnected() -> None:
        log.info("nats reconnected", connection=name, server=_server_of(nc))

    async def on_error(exc: Exception) -> None:
        error = str(exc) or type(exc).__name__
        if "permissions violation" in error.lower():  # the server refused what this role may not do: a bug or a misconfiguration
            log.error("nats refused an operation outside this service's permissions", connection=name, error=error)
        else:
            log.warning("nats error", connection=name, error=error)

    async def on_closed() -> None:
        log.info("nats connection closed", connection=name)

    nc = Client()
    try:
        await within(
            connect_timeout_s,
            nc.connect(
                servers=server_urls(url),
                name=name,
                **auth,
                **({"inbox_prefix": inbox_prefix} if inbox_prefix else {}),
                tls=tls,
                tls_hostname=tls_hostname,
                connect_timeout=min(2.0, connect_timeout_s),
                reconnect_time_wait=reconnect_wait_s,
                max_reconnect_attempts=-1,  # forever: a NATS restart must not end the service
                # A server that goes silent (frozen, or its host cut off) is left for another of the cluster's
                # within ~3 s (two pings unanswered), inside the registry's 6 s TTL, not the client's default 4 minutes.
                ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=2,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                error_cb=on_error,
                closed_cb=on_closed,
            ),
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        last_error = nc.last_error or exc
        await _close_quietly(nc)
        reason = str(last_error) or type(last_error).__name__
        raise BusConnectionError(f"could not connect to NATS at {url} within {connect_timeout_s:g}s: {reason}") from exc
    log.info("nats connected", connection=name, server=_server_of(nc))
    return nc


async def connect_once(url: str, name: str, *, timeout_s: float = 5.0, credentials: BusCredentials | None = None,
                       tls: ssl.SSLContext | None = None, inbox_prefix: str | None = None) -> Client:
    """A short-lived connection for one call (a probe, the operator's provisioning and control calls): no
    reconnecting; a failure raises to the caller, which reports it (nats-py's own error log, a traceback, stays
    out: a server reloading its config may reset a connection being made, and the caller asks again)."""

    async def on_error(exc: Exception) -> None:
        pass  # raised to the caller (a command's output may be JSON: nothing else is written)

    auth = credentials.connect_options() if credentials is not None else {}
    nc = Client()
    try:
        await within(timeout_s, nc.connect(servers=server_urls(url), name=name, connect_timeout=timeout_s,
                                           allow_reconnect=False, max_reconnect_attempts=0, tls=tls,
                                           error_cb=on_error, **auth,
                                           **({"inbox_prefix": inbox_prefix} if inbox_prefix else {})))
    except BaseException:
        await _close_quietly(nc)
        raise
    return nc


async def drain(nc: Client, timeout_s: float = 5.0) -> None:
    """Drain subscriptions and pending publishes, then close; gives up and closes after `timeout_s`."""
    if nc.is_closed:
        return
    try:
        if nc.is_connected:
            await within(timeout_s, nc.drain())
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("nats drain did not finish; closing", error=str(exc) or type(exc).__name__, timeout_s=timeout_s)
    await _close_quietly(nc, timeout_s=1.0)


class ShutdownSignal:
    """SIGTERM and SIGINT set `event`; a service's main waits on it. Create it inside the running loop."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("shutdown requested", signal=signal.Signals(sig).name, already=self.event.is_set())
        self.event.set()

    def set(self) -> None:
        """Ask for shutdown without a signal (tests, a fatal condition found in code)."""
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()

    def remove(self) -> None:
        """Give the signals back to their default handlers."""
        for sig in self.SIGNALS:
            self._loop.remove_signal_handler(sig)


def _server_of(nc: Client) -> str:
    url = nc.connected_url
    return url.netloc if url is not None else ""


async def _close_quietly(nc: Client, timeout_s: float = 1.0) -> None:
    try:
        await within(timeout_s, nc.close())
    except Exception as exc:  # closing a half-open client can fail in several ways; it is gone either way
        log.debug("nats close failed", error=str(exc) or type(exc).__name__)


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL as nats-py takes them (a cluster's as URL,URL,...)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def nats_endpoints(url: str) -> list[tuple[str, int]]:
    """(host, port) of every server in a NATS URL (comma-separated list allowed)."""
    endpoints = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" not in part:
            part = "nats://" + part
        parts = urlsplit(part)
        if not parts.hostname:
            raise ValueError(f"NATS URL {url!r} has no host")
        endpoints.append((parts.hostname, parts.port or 4222))
    if not endpoints:
        raise ValueError(f"NATS URL {url!r} names no server")
    return endpoints
