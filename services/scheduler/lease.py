"""A pulled request's hold on its JetStream message.

The scheduler acks a request once a worker has taken it; until then the
message is its own only for the consumer's ack wait, which routing renews
(in-progress acks) while it goes on. A scheduler that was frozen past that
wait has lost the message to a redelivery, maybe to another scheduler: it
must not hand the request over too (two workers would stream it), so it
checks the lease before each offer and drops a lapsed one unacked.
"""

import asyncio
import time
from dataclasses import dataclass, field

from shared.telemetry.logging import get_logger

log = get_logger(__name__)

LAPSE_MARGIN = 0.8  # judged lapsed at this share of the ack wait: the server's clock and the wire take the rest


def lease_lapsed(renewed_at: float, now: float, ack_wait_s: float) -> bool:
    """Whether a message last renewed at `renewed_at` may have been redelivered by `now` (monotonic seconds)."""
    return now - renewed_at >= ack_wait_s * LAPSE_MARGIN


@dataclass
class Lease:
    msg: object  # the JetStream message
    ack_wait_s: float
    renewed_at: float = field(default_factory=time.monotonic)  # when it was pulled, then each renewal sent

    def lapsed(self) -> bool:
        return lease_lapsed(self.renewed_at, time.monotonic(), self.ack_wait_s)

    async def keep(self) -> None:
        """Renew it every third of the ack wait until cancelled (run beside the routing)."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            if self.lapsed():
                return  # too late: renewing now could not undo a redelivery
            sent_at = time.monotonic()
            try:
                await self.msg.in_progress()
            except Exception as exc:  # connection trouble: the lease runs out, and `lapsed` says so
                log.warning("could not renew a request's lease", error=repr(exc))
                continue
            self.renewed_at = sent_at
