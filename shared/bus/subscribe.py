"""Typed receivers: decode every message with `contracts`, reject what does not decode.

A receiver never crashes on bad input. A message that is not what its subject
promises (`ContractError`) is logged with the subject and reason and counted in
`REJECTED[reason]` (plus the caller's `counter(subject, reason)`, if given):

- core NATS (`subscribe_typed`): when the sender waits for a reply, it gets a
  `RequestFailed(code="invalid_request")` carrying the request id if the
  payload had one; otherwise the message is dropped;
- JetStream (`fetch_loop`): the message is terminated, so it is never
  redelivered.

Good messages go to `handler(message, raw_msg)`; the raw NATS message lets the
handler reply, or ack/nak/in_progress/term a JetStream message.
"""

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from contracts import ContractError, Message, RequestFailed, Sender, decode_one_of
from contracts.codec import unpack
from shared.telemetry.log_limiter import LogLimiter
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

REJECTED: collections.Counter[str] = collections.Counter()  # rejected messages by ContractError.reason
_FORGED_LOG = LogLimiter()

MessageTypes = type[Message] | tuple[type[Message], ...]
Handler = Callable[[Any, Msg], Awaitable[None]]
RejectCounter = Callable[[str, str], None]  # (subject, reason)


async def subscribe_typed(
    nc: Client,
    subject: str,
    message_cls_or_tuple: MessageTypes,
    handler: Handler,
    *,
    queue: str = "",
    counter: RejectCounter | None = None,
) -> Subscription:
    """Subscribe to `subject` (in queue group `queue`, if given), handing decoded messages to `handler`."""

    async def on_msg(msg: Msg) -> None:
        try:
            message = decode(msg.data, message_cls_or_tuple)
        except ContractError as exc:
            _count_rejection(msg.subject, exc, counter)
            if msg.reply:
                await _reply_invalid(nc, msg, exc)
            return
        try:
            await handler(message, msg)
        except Exception:  # a handler bug must not end the subscription: log it and take the next message
            log.exception("message handler failed", subject=msg.subject, message_type=type(message).__name__)

    return await nc.subscribe(subject, queue=queue, cb=on_msg)


async def fetch_loop(
    sub: JetStreamContext.PullSubscription,
    message_cls_or_tuple: MessageTypes,
    handler: Handler,
    *,
    batch: int = 16,
    fetch_timeout_s: float = 1.0,
    counter: RejectCounter | None = None,
    room: Callable[[], int] | None = None,
    room_poll_s: float = 0.005,
) -> None:
    """Pull from a JetStream consumer forever (until cancelled), decoding each message.

    With `room`, at most `room()` messages are fetched at a time (and none while it is 0, checked every
    `room_poll_s`): the consumer keeps the rest for whichever subscriber has room.

    Malformed messages are terminated and counted. Each good message goes to
    `handler(message, raw_msg)`, which must ack, nak, term or keep it in
    progress; a message it leaves alone is redelivered after the consumer's
    ack wait. A handler that raises ends the loop with that exception (crash
    the service rather than lose work silently; the message is redelivered).
    The loop owns `sub`: it unsubscribes when it ends (the durable consumer stays),
    so that draining the connection later does not wait on its leftovers.
    """
    try:
        while True:
            wanted = batch if room is None else min(batch, room())
            if wanted <= 0:
                await asyncio.sleep(room_poll_s)
                continue
            try:
                msgs = await sub.fetch(wanted, timeout=fetch_timeout_s)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue  # nothing to do this round
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                log.info("fetch loop stopped: the connection is closing")
                return
            except nats.errors.Error as exc:  # reconnecting, a 409 from the server, ...: try again shortly
                log.warning("fetch failed; retrying", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(fetch_timeout_s)
                continue
            for msg in msgs:
                try:
                    message = decode(msg.data, message_cls_or_tuple)
                except ContractError as exc:
                    _count_rejection(msg.subject, exc, counter)
                    await msg.term()
                    continue
                await handler(message, msg)
    finally:
        await _unsubscribe_quietly(sub)


def decode(data: bytes, message_cls_or_tuple: MessageTypes) -> Message:
    """Decode `data` as the one class given, or as whichever of a tuple of classes its `type` names."""
    if isinstance(message_cls_or_tuple, tuple):
        return decode_one_of(data, *message_cls_or_tuple)
    return message_cls_or_tuple.decode(data)


def reject_unattributed(sender: Sender, what: str, reason: str) -> None:
    """A well-formed message its sender may not have sent (a forged token chunk, another worker's load): dropped,
    counted in `REJECTED["forged"]`, and said once a minute per sender."""
    REJECTED["forged"] += 1
    source = f"{sender.role}.{sender.instance_id}"
    quiet = _FORGED_LOG.allow(source)
    if quiet is not None:
        log.warning("message dropped: its sender may not send it", sender=source, message=what, reason=reason,
                    dropped_quietly_since=quiet)


def _count_rejection(subject: str, exc: ContractError, counter: RejectCounter | None) -> None:
    REJECTED[exc.reason] += 1
    if counter is not None:
        counter(subject, exc.reason)
    log.warning("message rejected", subject=subject, reason=exc.reason, error=str(exc))


async def _reply_invalid(nc: Client, msg: Msg, exc: ContractError) -> None:
    reply = RequestFailed(request_id=_recover_request_id(msg.data), code="invalid_request", message=str(exc))
    try:
        await nc.publish(msg.reply, reply.encode())
    except nats.errors.Error as publish_exc:
        log.warning("could not reply to a rejected message", subject=msg.subject, error=str(publish_exc))


def _recover_request_id(data: bytes) -> str:
    """The `request_id` of a payload that failed to decode, if it has a readable one; else ""."""
    try:
        request_id = unpack(data).get("request_id")
    except ContractError:
        return ""
    return request_id if isinstance(request_id, str) else ""


async def _unsubscribe_quietly(sub: JetStreamContext.PullSubscription) -> None:
    try:
        await sub.unsubscribe()
    except (nats.errors.Error, ValueError):  # already closed or draining: nothing left to stop
        pass
