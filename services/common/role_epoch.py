"""Role epochs: a switchable worker's count of its role switches, and what it takes under which. Pure.

A worker that switches between prefill and decode (`services.common.role_switch`) counts the switches from 0 in
`ServiceInfo.role_epoch`. Whoever routes work to one worker (the scheduler's handoff, a decode worker's prefill
offer) sends the epoch it saw; the worker takes the message only in that epoch and in the role the message is
for, else refuses it as "stale_role" and the sender routes it again. So a message routed before a switch is never
served after it, by the other role.
"""

from __future__ import annotations

SWITCHABLE_ROLES = ("decode", "prefill")
STALE_ROLE = "stale_role"  # the HandoffReply code of a refusal by epoch or role


def epoch_refusal(for_role: str, epoch: int | None, my_role: str, my_epoch: int) -> str | None:
    """Why a worker in `my_role` at `my_epoch` refuses a message meant for a `for_role` worker at `epoch`, or None.
    An epoch of None (a sender that does not say) is taken only by a worker that never switched."""
    if for_role != my_role:
        return f"the message is for a {for_role} worker; this one is {my_role} now (epoch {my_epoch})"
    if epoch is None:
        return None if my_epoch == 0 else f"the message carries no role epoch; this worker is at epoch {my_epoch}"
    if epoch != my_epoch:
        return f"the message was routed under role epoch {epoch}; this worker is at epoch {my_epoch} ({my_role})"
    return None


def switch_refusal(current: str, to: str, state: str, switchable: bool, switching: bool) -> tuple[str, str] | None:
    """(code, why) a worker refuses a switch from `current` to `to` while `state`, or None to go ahead."""
    if not switchable:
        return "not_switchable", "this worker was not started switchable (`up --role-switch`)"
    if to not in SWITCHABLE_ROLES:
        return "unknown_role", f"a worker switches to {' or '.join(SWITCHABLE_ROLES)}, not {to!r}"
    if to == current:
        return "same_role", f"this worker is {current} already"
    if switching:
        return "busy", "a switch is under way"
    if state not in ("ready", "waiting"):
        return "busy", f"this worker is {state}"
    return None
