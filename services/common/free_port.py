"""A TCP port to start a server on, chosen outside the kernel's ephemeral range.

A port the kernel hands out for `bind(port 0)` can be handed out again, to a listener on port 0 or an outgoing
connection of some other process, in the seconds before the server we pick it for binds it. Ports below (or
above) the ephemeral range are never handed out that way, so only another explicit choice can take one.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_RANGE = (32768, 60999)
LOWEST_PORT = 10000  # below it live the well-known and the commonly configured services' ports
HIGHEST_PORT = 65535


def ports_outside(ephemeral: tuple[int, int], lowest: int = LOWEST_PORT, highest: int = HIGHEST_PORT) -> list[range]:
    """The spans of [lowest, highest] that the ephemeral range [low, high] leaves free, the empty ones left out."""
    low, high = ephemeral
    spans = [range(lowest, min(low, highest + 1)), range(max(high + 1, lowest), highest + 1)]
    return [span for span in spans if len(span)]


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range; Linux's default where it cannot be read."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_RANGE
    return low, high


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind host:port now (with SO_REUSEADDR, as uvicorn and nats-server do)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", attempts: int = 100) -> int:
    """A port nothing uses on `host` now, outside the ephemeral range where there is room; the kernel's own
    choice (ephemeral) where there is none or every try found its port taken."""
    spans = ports_outside(ephemeral_range())
    sizes = [len(span) for span in spans]
    for _ in range(attempts if spans else 0):
        span = random.choices(spans, weights=sizes)[0]
        port = random.choice(span)
        if port_free(host, port):
            return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
