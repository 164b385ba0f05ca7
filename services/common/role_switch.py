"""Switching a worker between prefill and decode on the same engine: its weights and KV cache stay loaded.

The operator's `RoleSwitch` comes on the worker's own control subject, which only the admin key may publish to
(`shared.bus.permissions`), so every switch is the operator's (through `splitserve switch`, or the launcher's
control API). A switch:

    drain the old role, as on SIGTERM (a decode worker's streams finish, or go back to their gateways, which move
    them; a prefill worker pulls no more jobs and finishes those it holds) -> wait for the engine to hold nothing
    -> close the old role (its subscriptions, side channels, hooks into the engine) -> leave the registry under
    the old role -> serve under the new role and the next role epoch -> registered, ready

Routing never sees it in both roles: it drains as the old role, is absent, then ready as the new. A message routed
under the old epoch that arrives later is refused ("stale_role", `services.common.role_epoch`) and routed again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from contracts import RoleSwitch, RoleSwitchReply
from services.common.role_epoch import switch_refusal
from shared.bus.waits import within
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

PREFILL_FINISH_S = 10.0  # a draining prefill worker's jobs finish within this (then go back to the queue)
QUIESCE_S = 5.0  # the engine ends what the drain aborted within this


RoleBuilder = Callable[[object], Awaitable[object]]  # (worker) -> the role, built on its engine


class RoleSwitcher:
    def __init__(self, worker, builders: dict[str, RoleBuilder]):
        """`builders[role](worker)`: a new, unstarted role object of `role` on `worker`'s engine."""
        self.worker = worker
        self.builders = builders
        self.switches = 0
        self.last: dict = {}  # the last switch's figures (stats details)
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        w = self.worker
        await w.subscribe(w.subjects.role_switch(w.instance_id), RoleSwitch, self._on_switch)

    def details(self) -> dict:
        return {"epoch": self.worker.role_epoch, "switches": self.switches, "last": dict(self.last)}

    async def _on_switch(self, command: RoleSwitch, msg) -> None:
        reply = await self.switch(command.to, command.drain_s)
        if msg.reply:
            await msg.respond(reply.encode())

    async def switch(self, to: str, drain_s: float | None = None) -> RoleSwitchReply:
        w = self.worker
        refused = switch_refusal(w.identity.role, to, w.state, True, self._lock.locked())
        if refused is not None:
            return RoleSwitchReply(ok=False, role=w.identity.role, role_epoch=w.role_epoch, code=refused[0],
                                   error=refused[1])
        async with self._lock:
            received = time.monotonic()
            old = w.identity.role
            log.info("role switch: draining", role=old, to=to)
            await self._drain(old, drain_s)
            drained = time.monotonic()
            await self._serve_as(to)
            done = time.monotonic()
        self.switches += 1
        self.last = {"from": old, "to": to, "epoch": w.role_epoch, "drain_s": round(drained - received, 4),
                     "switch_s": round(done - drained, 4), "total_s": round(done - received, 4)}
        log.info("role switch: serving", **self.last)
        return RoleSwitchReply(ok=True, role=to, role_epoch=w.role_epoch, drain_s=drained - received,
                               switch_s=done - drained)

    async def _drain(self, old: str, drain_s: float | None) -> None:
        """The old role stops taking work and ends what it holds; its tasks stop once it has."""
        w = self.worker
        w.lifecycle = "draining"
        try:  # routing sees it at once, not a heartbeat later
            await within(w.registry.ttl_s, w.registry.put(w.info()))
        except Exception as exc:  # the heartbeat says it soon
            log.warning("could not say draining in the registry", error=repr(exc))
        # Unwatched from here: a task that ends while the role unsubscribes does not stop the service.
        old_tasks = w.set_role_tasks([])
        wait_s = drain_s if drain_s is not None else (None if old == "decode" else PREFILL_FINISH_S)
        await w.role.drain(wait_s)
        deadline = time.monotonic() + QUIESCE_S
        while w.engine.num_running + w.engine.num_waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if w.engine.num_running + w.engine.num_waiting:
            log.warning("the engine still holds requests after the drain", running=w.engine.num_running,
                        waiting=w.engine.num_waiting)
        for task in old_tasks:
            task.cancel()
        await asyncio.gather(*old_tasks, return_exceptions=True)
        await w.role.close()

    async def _serve_as(self, to: str) -> None:
        """Leave the registry as the old role, start the new one, register it ready."""
        w = self.worker
        await w.heartbeat.stop(remove=True)
        w.rename(to)
        w.role = await self.builders[to](w)
        w.set_role_tasks(await w.role.start())
        await w.nc.flush()
        w.lifecycle = "ready"
        try:
            await within(w.registry.ttl_s, w.registry.put(w.info()))
        except Exception as exc:  # the heartbeat puts it
            log.warning("could not register the new role at once", error=repr(exc))
        w.heartbeat.start()


def switchable(worker, settings, builders: dict[str, RoleBuilder]) -> None:
    """With `--role-switch`: the worker takes the operator's role switches, to any role of `builders`."""
    if settings.role_switch:
        worker.role_switch = RoleSwitcher(worker, builders)
