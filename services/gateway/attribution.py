"""Whom the gateway believes about a request: the scheduler that routed it, then only the worker it names.

Every event for a request arrives on a subject that names its sender (`contracts.sent_by`, vouched for by the
sender's NATS permissions). The scheduler's `Assignment` says which worker took the request; from then on only
that worker speaks for it. A worker's events that come before the assignment (they travel on another
connection, so they may) are held until it arrives. Pure: the verdicts, not the queues.
"""

from typing import Literal

from contracts import Assignment, RequestFailed, Sender

Verdict = Literal["accept", "hold", "forged", "again"]
ROUTER_ROLE = "scheduler"


def judge(sender: Sender, event, routed_to: str | None) -> Verdict:
    """What to do with `event` from `sender` for a request routed to the worker `routed_to` (None: not yet).
    "again": the scheduler's assignment, repeated (a redelivered request offered to the same worker)."""
    if sender.role == ROUTER_ROLE:
        if isinstance(event, Assignment):
            if routed_to is None:
                return "accept"
            return "again" if event.worker_instance == routed_to else "forged"
        # A scheduler fails a request it could not route; once a worker has it, only that worker may.
        return "accept" if isinstance(event, RequestFailed) and routed_to is None else "forged"
    if isinstance(event, Assignment):
        return "forged"  # only a scheduler assigns
    if routed_to is None:
        return "hold"
    return "accept" if sender.instance_id == routed_to else "forged"
