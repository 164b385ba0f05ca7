"""Where a service's side channel listens, and the address it tells its peers to dial.

A receiver binds one address and advertises it in every ticket, so it must be one the peers reach: given with
`--advertise-host`, or else the address of this machine's interface that routes to NATS (on another machine
than NATS that is never loopback; beside a local NATS it is 127.0.0.1, as on one machine). The per-channel
flags (`--kv-receiver-host`, `--transfer-host`, ...) still win where given.
"""

import socket
from collections.abc import Callable

from shared.bus.connection import nats_endpoints

WILDCARDS = ("0.0.0.0", "::", "")


def route_address(nats_url: str) -> str:
    """This machine's address on the interface that routes to the first server of `nats_url`."""
    host, port = nats_endpoints(nats_url)[0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        host = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))  # UDP: picks the route and the source address, sends nothing
            return sock.getsockname()[0]
    except OSError as exc:
        raise OSError(f"cannot tell which address reaches NATS at {host}:{port} ({exc}); "
                      "give --advertise-host") from exc


def side_channel_addresses(listen: str | None, advertise: str | None, advertise_host: str | None,
                           routed: Callable[[], str]) -> tuple[str, str | None]:
    """(listen on, advertise) for one receiver: its own flags (`listen`, `advertise`) where given, else the
    service's `--advertise-host`, else `routed()` (the address toward NATS), bound and advertised alike."""
    if listen is not None:
        return listen, advertise or (advertise_host if listen in WILDCARDS else None)
    chosen = advertise or advertise_host or routed()
    return chosen, chosen
