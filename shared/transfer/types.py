"""The plain values of the side channel: the ticket, the result, the failure reasons and the counters."""

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Why a transfer failed. Each side counts its failures under one of these.
DEADLINE = "deadline"  # the ticket's deadline passed
STALLED = "stalled"  # one read or write made no progress for `io_timeout_s`
CANCELLED = "cancelled"  # the receiver cancelled the expectation
CORRUPTED = "corrupted"  # a payload did not match its checksum
PROTOCOL = "protocol"  # a malformed or unexpected frame (bad layers, dtype, shape, size, order)
TOO_LARGE = "too-large"  # a part larger than the receiver accepts
INCOMPLETE = "incomplete"  # the sender ended the transfer with layers missing
CONNECTION = "connection"  # the connection failed or closed early
SENDER_ABORTED = "sender-aborted"  # the sender's part producer failed; the sender said so
ON_PART_ERROR = "on-part-error"  # the receiver's on_part callback raised
SHM_ERROR = "shm-error"  # a shared-memory segment could not be created, opened or read
SOURCE_RELEASED = "source-released"  # the sender let go of blocks the receiver was reading in place
REJECTED = "rejected"  # (sender side) the receiver refused the handshake: unknown transfer or wrong token
UNAUTHENTICATED_RECEIVER = "receiver-unauthenticated"  # (sender side) the receiver could not prove it knows the token
STOPPED = "stopped"  # the receiver or sender was stopped
BAD_INPUT = "bad-input"  # (sender side) a part given to `send` is not valid
TLS = "tls"  # the TLS handshake failed (a certificate not trusted), or only one side speaks TLS

REASONS = (
    DEADLINE, STALLED, CANCELLED, CORRUPTED, PROTOCOL, TOO_LARGE, INCOMPLETE, CONNECTION, SENDER_ABORTED,
    ON_PART_ERROR, SHM_ERROR, SOURCE_RELEASED, REJECTED, UNAUTHENTICATED_RECEIVER, STOPPED, BAD_INPUT, TLS,
)

BACKENDS = ("shm", "tcp")


class TransferFailed(Exception):
    """A transfer failed for `reason` (one of `REASONS`); the message says what happened."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(slots=True)
class TransferTicket:
    """Made by the receiver for one expected transfer; travels to the sender inside a NATS message.

    `token` proves the sender is the one the receiver meant: it never crosses the
    side channel in clear, only HMACs keyed by it do. `endpoint` is where the
    receiver listens (`host`, `port`), which shared-memory domain it is in
    (`host_id`: a sender with the same `host_id` can use `shm`) and whether it
    takes TLS only (`tls`, absent: no).
    """

    transfer_id: str
    token: bytes = field(repr=False)  # a secret: never in a log line or an error message
    endpoint: dict
    deadline_unix_s: float

    def to_dict(self) -> dict:
        return {
            "transfer_id": self.transfer_id,
            "token": bytes(self.token),
            "endpoint": {"host": self.endpoint["host"], "port": int(self.endpoint["port"]),
                         "host_id": self.endpoint["host_id"], "tls": bool(self.endpoint.get("tls", False))},
            "deadline_unix_s": float(self.deadline_unix_s),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TransferTicket":
        """Decode a ticket; raises `ValueError` naming the field when something is missing or mistyped."""
        if not isinstance(data, dict):
            raise ValueError(f"a transfer ticket is a map, got {type(data).__name__}")
        try:
            transfer_id, token, endpoint, deadline = (
                data["transfer_id"], data["token"], data["endpoint"], data["deadline_unix_s"])
        except KeyError as exc:
            raise ValueError(f"transfer ticket without {exc.args[0]!r}") from None
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError("transfer ticket transfer_id must be a non-empty string")
        if not isinstance(token, (bytes, bytearray)) or len(token) < 16:
            raise ValueError("transfer ticket token must be at least 16 bytes")
        if not isinstance(endpoint, dict) or not {"host", "port", "host_id"} <= set(endpoint):
            raise ValueError("transfer ticket endpoint must be a map with host, port and host_id")
        if not isinstance(endpoint["host"], str) or not isinstance(endpoint["host_id"], str):
            raise ValueError("transfer ticket endpoint host and host_id must be strings")
        if not isinstance(endpoint["port"], int) or isinstance(endpoint["port"], bool) or not 0 < endpoint["port"] < 65536:
            raise ValueError("transfer ticket endpoint port must be an integer in 1..65535")
        if not isinstance(endpoint.get("tls", False), bool):
            raise ValueError("transfer ticket endpoint tls must be true or false")
        if not isinstance(deadline, (int, float)) or isinstance(deadline, bool):
            raise ValueError("transfer ticket deadline_unix_s must be a number")
        return cls(transfer_id, bytes(token), dict(endpoint), float(deadline))


@dataclass(slots=True)
class TransferResult:
    """How one transfer ended, on one side. `reason` is the machine-readable part of `error`."""

    ok: bool
    error: str | None
    backend: str
    num_bytes: int
    seconds: float
    reason: str | None = None

    @classmethod
    def failed(cls, exc: TransferFailed, backend: str, num_bytes: int, seconds: float) -> "TransferResult":
        return cls(False, str(exc), backend, num_bytes, seconds, exc.reason)

    def span_attributes(self, prefix: str = "splitserve.kv_transfer") -> dict:
        """Trace span attributes: backend, bytes, time, bandwidth, and why it failed."""
        attributes = {f"{prefix}.ok": self.ok, f"{prefix}.backend": self.backend, f"{prefix}.bytes": self.num_bytes,
                      f"{prefix}.seconds": self.seconds}
        if self.seconds > 0:
            attributes[f"{prefix}.gbytes_per_s"] = self.num_bytes / self.seconds / 1e9
        if self.error:
            attributes[f"{prefix}.error"] = self.error
        return attributes


@dataclass
class TransferStats:
    """Counters of one sender or receiver. `snapshot()` gives plain types for metrics and logs."""

    bytes_by_backend: Counter = field(default_factory=Counter)  # payload bytes applied (receiver) or acked (sender), per part
    ok_by_backend: Counter = field(default_factory=Counter)
    failed_by_reason: Counter = field(default_factory=Counter)
    failed_by_backend: Counter = field(default_factory=Counter)
    unauthenticated: int = 0  # receiver: connections closed for a wrong token or unknown transfer
    corrupted_parts: int = 0  # receiver: payloads that failed their checksum
    discarded_parts: int = 0  # receiver: parts that arrived for a cancelled or finished transfer
    in_place_parts: int = 0  # parts read from the sender's shared-memory region, not staged (sent / applied)
    connections: int = 0  # connections accepted (receiver) or made (sender)
    refused_connections: int = 0  # receiver: connections closed at once because too many were open
    evicted_handshakes: int = 0  # receiver: silent unauthenticated connections closed to make room for new ones
    retried_connections: int = 0  # sender: connections lost before the receiver took anything, made again

    def record(self, result: TransferResult) -> None:
        if result.ok:
            self.ok_by_backend[result.backend] += 1
        else:
            self.failed_by_reason[result.reason or "unknown"] += 1
            self.failed_by_backend[result.backend] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "bytes_by_backend": dict(self.bytes_by_backend),
            "ok_by_backend": dict(self.ok_by_backend),
            "failed_by_reason": dict(self.failed_by_reason),
            "failed_by_backend": dict(self.failed_by_backend),
            "unauthenticated": self.unauthenticated,
            "evicted_handshakes": self.evicted_handshakes,
            "retried_connections": self.retried_connections,
            "corrupted_parts": self.corrupted_parts,
            "discarded_parts": self.discarded_parts,
            "in_place_parts": self.in_place_parts,
            "connections": self.connections,
            "refused_connections": self.refused_connections,
        }
