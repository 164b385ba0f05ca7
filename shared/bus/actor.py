"""The actor: one task owns one piece of state and handles one message at a time.

Nothing else touches an actor's state; other code `tell`s it a message. The
mailbox is bounded: a full mailbox refuses the message at once (`MailboxFull`),
and the caller turns that into an "overloaded" reply rather than waiting. If
`handle` raises, the actor is broken, not just that message: `run` logs the
failure and re-raises, the service's main (`run_until_stopped`) sees the task
end and exits non-zero, and the supervisor starts a fresh process.
"""

import asyncio
from typing import Any

from shared.telemetry.logging import get_logger

log = get_logger(__name__)


class MailboxFull(Exception):
    """The actor's mailbox holds `maxsize` messages already."""


class Actor:
    def __init__(self, name: str, mailbox_size: int = 1024):
        if mailbox_size < 1:
            raise ValueError(f"mailbox_size must be positive, got {mailbox_size}")
        self.name = name
        self.mailbox: asyncio.Queue = asyncio.Queue(maxsize=mailbox_size)
        self.num_handled = 0

    def tell(self, msg: Any) -> None:
        """Enqueue `msg` without waiting; raises `MailboxFull` when the mailbox is full."""
        try:
            self.mailbox.put_nowait(msg)
        except asyncio.QueueFull:
            raise MailboxFull(f"actor {self.name!r} has {self.mailbox.maxsize} messages waiting") from None

    async def run(self) -> None:
        """Handle messages in arrival order, forever (until cancelled or `handle` raises)."""
        while True:
            msg = await self.mailbox.get()
            try:
                await self.handle(msg)
            except Exception:
                log.exception("actor crashed", actor=self.name, message_type=type(msg).__name__)
                raise
            self.num_handled += 1
            self.mailbox.task_done()

    async def handle(self, msg: Any) -> None:
        """Subclass hook: act on one message. Raising crashes the actor (and so the process)."""
        raise NotImplementedError
