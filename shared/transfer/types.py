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
