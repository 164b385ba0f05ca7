"""The bulk side channel: moves KV tensors between processes, outside NATS.

NATS carries only a `TransferTicket` (who, where, until when, and a per-transfer
token); the bytes go over shared memory when both ends share a host (`shm`) and
over TCP otherwise (`tcp`). Transfers are authenticated (HMAC over the token,
both ways), integrity-checked (a checksum per payload), bounded in time (the
ticket's deadline, plus a stall timeout on every read and write) and in memory
(bytes in flight per transfer, receive buffers, shared-memory pools), and can
stream layer by layer.

    # decode process
    receiver = KVReceiver(); await receiver.start()
    ticket = receiver.expect(tid, on_part=copy_into_cache, total_layers=(0, L), deadline_s=10)
    ...send the ticket to the prefill worker inside a NATS message (contracts.TransferTicket)...
    result = await receiver.wait(tid)

    # prefill process
    sender = KVSender()
    result = await sender.send(ticket, layer_parts())   # (start, end, tensor) items

`cuda_ipc` is not implemented: both backends move CPU bytes (a CUDA tensor given
to `send` is copied to host memory first).
"""

from contracts import TransferTicket  # the side channel's ticket is the wire's
from shared.transfer.checksum import ALGORITHMS as CHECKSUM_ALGORITHMS
from shared.transfer.receiver import KVReceiver
from shared.transfer.sender import KVSender
from shared.transfer.shm import host_id, shm_available, sweep_orphan_segments
from shared.transfer.types import (
    BACKENDS,
    REASONS,
    TransferFailed,
    TransferResult,
    TransferStats,
)

__all__ = [
    "BACKENDS",
    "CHECKSUM_ALGORITHMS",
    "KVReceiver",
    "KVSender",
    "REASONS",
    "TransferFailed",
    "TransferResult",
    "TransferStats",
    "TransferTicket",
    "host_id",
    "shm_available",
    "sweep_orphan_segments",
]
