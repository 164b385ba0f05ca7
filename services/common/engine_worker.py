"""`EngineWorker`: the shell every service that runs an engine shares; a role says what the service does.

The shell owns what every such worker has: its identity and registry entry (kept fresh by a heartbeat),
the engine loop on the engine's thread and the bridge that brings its outputs back to the event loop in
order, stats replies, cancels, the KV-event publisher, the kv-store tier (with `--kv-store`), parts that
come and go with it (a pipeline head's driver), and teardown in one order. A role (`DecodeRole`,
`PrefillRole`) subscribes its own subjects, handles the engine's outputs and cancels, says its load and
details for the registry entry, and drains its work when the worker stops.
"""

import asyncio
import dataclasses
from typing import Protocol

from contracts import CancelRequest, Sender, ServiceInfo, ServiceStats, StatsRequest, Subjects, WorkerLoad, sent_by
from services.common.cpu_follow import cpu_share_details
from services.common.cpu_loan import CpuShare
from services.common.engine_loop import EngineLoop, RequestRejected
from services.common.engine_thread import EngineThread
from services.common.identity import ServiceIdentity, now_ms
from services.common.kv_event_publisher import engine_kv_events, kv_hashing
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, subscribe_typed
from shared.engine import LLMEngine, RequestOutput
from shared.telemetry.logging import get_logger
from shared.transfer.shm import segments_held

log = get_logger(__name__)

LOAD_REPORT_S = 0.05  # how often the load is looked at, and sent (`WorkerLoad`) when it changed


class WorkerRole(Protocol):
    async def start(self) -> list[asyncio.Task]:
        """Subscribe the role's subjects; the tasks it runs (any that ends stops the service)."""

    async def on_outputs(self, items: list[RequestOutput | RequestRejected]) -> None:
        """One engine step's outputs, on the event loop, in step order."""

    async def on_cancel(self, cancel: CancelRequest) -> None:
        """A request is cancelled (it may not be this worker's)."""

    def load(self) -> dict:
        """The registry entry's load fields (num_running, num_waiting, max_num_seqs; a decode worker's
        active_requests and handoffs_taken), also in its `WorkerLoad` reports."""

    def details(self) -> dict:
        """The role's part of the registry entry's details."""

    async def lapsed(self) -> None:
        """This worker's registry entry lapsed (it stalled, or lost NATS, for longer than the registry's TTL): its
        peers have taken what it held elsewhere. Drop what another worker now runs."""

    async def drain(self, wait_s: float | None = None) -> None:
        """Stop taking work and end (or hand back) what runs; the engine still runs meanwhile. `wait_s`: how long
        what runs may go on first (None: the role's own drain time)."""

    async def close(self) -> None:
        """Once its work is over (the engine stopped, or the worker switches role): close what the role opened
        (subscriptions, side channels, its hooks into the engine)."""


class WorkerPart(Protocol):
    """Something a worker runs beside its role (a pipeline head's driver): started first, stopped last."""

    async def start(self) -> list[asyncio.Task]: ...

    async def stop(self) -> None: ...

    def details(self) -> dict: ...

    def waiting_for(self) -> str | None:
        """What the worker cannot serve without now (a pipeline stage that is gone); None when nothing."""


class EngineWorker:
    def __init__(self, *, nc, registry: Registry, subjects: Subjects, engine: LLMEngine, engine_thread: EngineThread,
                 instance_id: str, role: str, model: str, served_model_name: str, cpu_share: CpuShare | None = None,
                 gather_s: float = 0.0):
        self.nc = nc
        self.registry = registry
        self.subjects = subjects
        self.engine = engine
        self.instance_id = instance_id
        self.model = model
        self.served_model_name = served_model_name
        self.identity = ServiceIdentity(instance_id, role)
        self.lifecycle = "starting"  # then "ready", then "draining"
        self.role: WorkerRole | None = None
        self.role_epoch = 0  # role switches since start (`services.common.role_switch`)
        self.role_switch = None  # a RoleSwitcher, on a worker started switchable
        self._role_tasks: list[asyncio.Task] = []  # the current role's (a switch replaces them)
        self._role_changed = asyncio.Event()
        self.parts: list[WorkerPart] = []
        self.kv_store = None  # services.kvstore.tier.KVStoreTier, with --kv-store
        self._loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue = asyncio.Queue()  # one engine step's outputs per item, in order
        self.engine_loop = EngineLoop(engine, self._from_engine_thread, engine_thread, cpu_share, gather_s)
        self.kv_events = engine_kv_events(nc=nc, subjects=subjects, identity=self.identity, engine=engine,
                                          engine_loop=self.engine_loop)
        self.heartbeat = Heartbeat(registry, self.info, on_lapse=self._on_lapse)

    @property
    def state(self) -> str:
        """What the registry shows and handoffs go by: "waiting" while a part lacks what it serves with (a
        pipeline head whose stage is gone), so that nothing is routed to it until that is back."""
        if self.lifecycle == "ready" and any(part.waiting_for() for part in self.parts):
            return "waiting"
        return self.lifecycle

    async def subscribe(self, subject: str, message_cls, handler):
        return await subscribe_typed(self.nc, subject, message_cls, handler)

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> list[asyncio.Task]:
        if self.role is None:
            raise RuntimeError("an EngineWorker needs a role before it starts")
        part_tasks = [task for part in self.parts for task in await part.start()]
        self.engine_loop.start()
        await self.subscribe(self.subjects.cancel, CancelRequest, self._on_cancel)
        await self.subscribe(self.subjects.stats(self.instance_id), StatsRequest, self._on_stats)
        self._role_tasks = await self.role.start()
        if self.role_switch is not None:
            await self.role_switch.start()
        event_tasks = await self.kv_events.start()
        await self.nc.flush()
        self.lifecycle = "ready"
        self.heartbeat.start()
        return [asyncio.create_task(self._deliver_outputs(), name="engine-outputs"),
                asyncio.create_task(self._report_load(), name="load-reports"),
                asyncio.create_task(self._run_role_tasks(), name="role-tasks"), *part_tasks, *event_tasks]

    async def _run_role_tasks(self) -> None:
        """Ends as the current role's first task ends (which stops the service); a switch swaps the tasks."""
        while True:
            tasks = self._role_tasks
            changed = asyncio.create_task(self._role_changed.wait())
            try:
                done, _ = await asyncio.wait([*tasks, changed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
            self._role_changed.clear()
            if tasks is not self._role_tasks:
                continue  # swapped: the old ones were cancelled by the switch
            for task in done:
                if task is not changed:
                    task.result()  # raises what the role's task raised
                    return

    def set_role_tasks(self, tasks: list[asyncio.Task]) -> list[asyncio.Task]:
        """The role's tasks from now on; returns the old ones (for the switch to cancel)."""
        old, self._role_tasks = self._role_tasks, tasks
        self._role_changed.set()
        return old

    def rename(self, role: str) -> None:
        """Serve as `role` from now on (a switch): the registry entry, and the name every signed message carries."""
        self.identity = dataclasses.replace(self.identity, role=role)
        self.role_epoch += 1
        self.kv_events.role = role
        if self.kv_store is not None:
            self.kv_store.client.me = Sender(role, self.instance_id)

    async def drain(self) -> None:
        """Stop taking work and let the role end what runs (or hand it back), outputs still streaming."""
        if self.lifecycle != "draining":
            self.lifecycle = "draining"
            await self.role.drain()

    async def stop(self) -> None:
        """Drain (if not yet), stop the engine, close everything, leave the registry."""
        await self.drain()
        await asyncio.to_thread(self.engine_loop.stop, 1.0)  # a step in flight may not finish: the thread is a daemon
        await self.role.close()
        if self.kv_store is not None:
            await self.kv_store.stop()
        for part in self.parts:
            await part.stop()
        await self.heartbeat.stop(remove=True)

    async def _on_lapse(self, gap_s: float) -> None:
        log.warning("this worker's registry entry lapsed: dropping what its peers moved elsewhere",
                    seconds_since_last_heartbeat=round(gap_s, 1))
        await self.role.lapsed()

    def info(self) -> ServiceInfo:
        block_manager = self.engine.block_manager
        return self.identity.info(
            model=self.model, served_model_name=self.served_model_name, state=self.state,
            kv_blocks_total=block_manager.num_blocks, kv_blocks_free=block_manager.num_free_blocks,
            max_model_len=self.engine.max_model_len, uses_kv_store=self.kv_store is not None,
            publishes_kv_events=True, layer_range=self._layer_range(), role_epoch=self.role_epoch,
            **kv_hashing(self.engine),
            **self.role.load(),
        )

    def stats(self) -> ServiceStats:
        details = {"rejected_messages": dict(REJECTED), "prefix_cache": self.engine.prefix_cache_counts(),
                   "preemptions": self.engine.preemption_counts(),
                   "kv_store": self.kv_store.details() if self.kv_store is not None else {},
                   "kv_events": dict(self.kv_events.counts), **cpu_share_details(self.engine_loop.cpu_share),
                   "registry_lapses": self.heartbeat.num_lapses,
                   "registry_outages": self.heartbeat.num_outages, "shm_segments": segments_held(),
                   "kv_memory_sizing": self.engine.memory_sizing, "engine_steps": self.engine_loop.steps.details(),
                   **self.role.details(),
                   **({"role_switch": self.role_switch.details()} if self.role_switch is not None else {})}
        for part in self.parts:
            details.update(part.details())
        return ServiceStats.of(self.info(), details)

    def _layer_range(self) -> tuple[int, int] | None:
        """A pipeline head's own layers (the rest run on its stages); None when the engine runs them all."""
        end = self.engine.local_layers_end
        return (0, end) if end < self.engine.model_config.num_hidden_layers else None

    def load_report(self) -> WorkerLoad:
        load = self.role.load()
        return WorkerLoad(instance_id=self.instance_id, boot_id=self.identity.boot_id, sent_ms=now_ms(),
                          num_running=load.get("num_running", 0), num_waiting=load.get("num_waiting", 0),
                          kv_blocks_free=self.engine.block_manager.num_free_blocks,
                          active_requests=load.get("active_requests", 0), handoffs_taken=load.get("handoffs_taken", 0))

    async def _report_load(self) -> None:
        """Say the load as it changes: a request that ended shows at once, not a heartbeat later."""
        last = None
        while True:
            await asyncio.sleep(LOAD_REPORT_S)
            report = self.load_report()
            figures = (report.num_running, report.num_waiting, report.kv_blocks_free, report.active_requests,
                       report.handoffs_taken)
            if figures == last:
                continue
            try:
                await self.nc.publish(sent_by(self.subjects.worker_load, self.identity.role, self.instance_id),
                                      report.encode())
                last = figures
            except Exception as exc:  # reconnecting: the next change (or the heartbeat) tells it
                log.warning("could not report the load", error=repr(exc))

    # ---- the engine's outputs ---------------------------------------------------------
    def deliver(self, items: list[RequestOutput | RequestRejected]) -> None:
        """Hand outputs made on the event loop (a pipeline reset's failures) to the role, after those before."""
        self._outputs.put_nowait(items)

    def _from_engine_thread(self, items: list[RequestOutput | RequestRejected]) -> None:
        self._loop.call_soon_threadsafe(self._outputs.put_nowait, items)

    async def _deliver_outputs(self) -> None:
        while True:
            items = await self._outputs.get()
            if self.engine_loop.crashed is not None:  # it sends nothing more: the service must end
                raise RuntimeError("the engine loop crashed") from self.engine_loop.crashed
            await self.role.on_outputs(items)

    # ---- handlers ---------------------------------------------------------------------
    async def _on_cancel(self, cancel: CancelRequest, msg) -> None:
        await self.role.on_cancel(cancel)

    async def _on_stats(self, _: StatsRequest, msg) -> None:
        if msg.reply:
            await msg.respond(self.stats().encode())
