"""`PipelineDriver`: a pipeline head's side of the pipeline, the same for a decode head and a prefill head.

It sends each step the head's engine starts to the first stage, puts what
comes back (logits, or a failure) into the engine, and watches the stages in
the registry. A stage that is gone, or came back with a new boot id (an empty
KV cache), ends every running request with an error at once (the KV they had
at that stage is lost) and the cached prefixes are forgotten; steps started
while a stage is gone fail at once rather than wait for their deadline.
"""

import asyncio
import time
from collections.abc import Callable
from typing import NamedTuple

from contracts import StageActivation, StageShipment, StepTrace, TransferTicket
from services.common.engine_loop import EngineLoop
from services.common.identity import now_ms
from services.stage.link import ActivationLink
from shared.bus.registry import Readings, Registry
from shared.engine import PipelineHeadEngine, RequestOutput, ShipKV, StepBatch, StepResult
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

_WATCH_INTERVAL_S = 0.5
_MAX_TRACED_PER_STEP = 16  # requests of one step whose trace gets the stages' spans


async def wait_for_stages(registry: Registry, stages: list[str], timeout_s: float) -> dict:
    """The registry entries of `stages` once all are registered and ready; TimeoutError naming the missing."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        entries = {info.instance_id: info for info in await registry.list()}
        ready = {iid: entries[iid] for iid in stages if iid in entries and entries[iid].state == "ready"}
        if len(ready) == len(stages):
            return ready
        if asyncio.get_running_loop().time() > deadline:
            missing = [iid for iid in stages if iid not in ready]
            raise TimeoutError(f"pipeline stages not ready after {timeout_s:g} s: {', '.join(missing)}")
        await asyncio.sleep(0.2)


class Shipping(NamedTuple):
    """How a prefill pipeline's stages ship one request's KV: the decode worker's ticket, and the head's attempt
    at the job (a stage's report names it, so a late report of an earlier attempt does not count)."""

    ticket: TransferTicket
    attempt: str


class PipelineDriver:
    """Made before its head (the engine's `submit` needs it), attached to it once the head exists."""

    def __init__(self, *, instance_id: str, registry: Registry, link: ActivationLink, stages: list[str],
                 stage_boot_ids: dict[str, str]):
        self.instance_id = instance_id
        self.registry = registry
        self.link = link
        self.stages = stages
        self.stage_boot_ids = dict(stage_boot_ids)
        self.engine: PipelineHeadEngine | None = None
        self.engine_loop: EngineLoop | None = None
        self.boot_id = ""
        self.on_reset: Callable[[list[RequestOutput]], None] = lambda outputs: None
        self.shipment_of: Callable[[str], Shipping | None] = lambda request_id: None
        self.trace_of: Callable[[str], dict[str, str] | None] = lambda request_id: None
        self.stages_missing: list[str] = []
        self.resets = 0
        self._sends: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, *, engine: PipelineHeadEngine, engine_loop: EngineLoop, boot_id: str,
               on_reset: Callable[[list[RequestOutput]], None],
               shipment_of: Callable[[str], Shipping | None] | None = None,
               trace_of: Callable[[str], dict[str, str] | None] | None = None) -> None:
        """`on_reset(outputs)` publishes the failures a reset produced (on the event loop);
        `shipment_of(request_id)` says how the stages ship a request's KV (a prefill head's requests), None
        for requests whose KV stays; `trace_of(request_id)` is the request's trace context (headers), None if
        it has none."""
        self.engine = engine
        self.engine_loop = engine_loop
        self.boot_id = boot_id
        self.on_reset = on_reset
        if shipment_of is not None:
            self.shipment_of = shipment_of
        if trace_of is not None:
            self.trace_of = trace_of

    async def start(self) -> list[asyncio.Task]:
        self._loop = asyncio.get_running_loop()
        await self.link.start()
        return [asyncio.create_task(self._take_results(), name="pipeline-results"),
                asyncio.create_task(self._watch_stages(), name="pipeline-watch")]

    async def stop(self) -> None:
        await self.link.stop()
        await self.link.receiver.stop()
        self.link.sender.close()

    def waiting_for(self) -> str | None:
        return f"pipeline stage {self.stages_missing[0]}" if self.stages_missing else None

    def details(self) -> dict:
        engine = self.engine
        return {
            "stages": list(self.stages),
            "microbatches": len(engine.schedulers), "steps_started": engine.steps_started,
            "steps_failed": engine.steps_failed, "steps_in_flight": engine.num_in_flight,
            "stages_missing": list(self.stages_missing), "resets": self.resets,
            "parameter_bytes": sum(r.loaded.parameter_bytes for r in engine.executor.runners),
            "link": dict(self.link.stats), "utilization": engine.utilization.snapshot(),
        }

    # ---- steps out (from the engine thread) and results in ------------------------------------
    def submit(self, step_id: int, batch: StepBatch, hidden, shipping: list[ShipKV],
               prompt_chunks: list[tuple[str, int]]) -> None:
        """The engine's `submit`: called on the engine thread, right after the head's own layers. The stage
        boot ids are taken here: they change only on the engine thread, with the reset that goes with them."""
        boots = dict(self.stage_boot_ids)
        self._loop.call_soon_threadsafe(self._send_step, step_id, batch, hidden, shipping, prompt_chunks, boots)

    def _send_step(self, step_id: int, batch: StepBatch, hidden, shipping: list[ShipKV],
                   prompt_chunks: list[tuple[str, int]], boots: dict) -> None:
        traces = []
        for request_id, tokens in prompt_chunks[:_MAX_TRACED_PER_STEP]:
            carrier = self.trace_of(request_id) or {}
            if carrier.get("traceparent"):
                traces.append(StepTrace(request_id=request_id, tokens=tokens, traceparent=carrier["traceparent"],
                                        tracestate=carrier.get("tracestate", "")))
        ship = []
        for item in shipping:
            shipment = self.shipment_of(item.request_id)
            if shipment is not None:
                ship.append(StageShipment(request_id=item.request_id, ticket=shipment.ticket,
                                          attempt=shipment.attempt, block_ids=list(item.block_ids),
                                          num_tokens=item.num_tokens))
        step = StageActivation(step_id=step_id, head=self.instance_id, head_boot_id=self.boot_id,
                               route=list(self.stages), batch=batch, stage_boot_ids=boots,
                               kind="hidden", ship=ship, traces=traces,
                               deadline_ms=now_ms() + int(self.engine.step_timeout_s * 1000))
        task = asyncio.create_task(self._send(step, hidden))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(self, step: StageActivation, hidden) -> None:
        if self.stages_missing:
            self.engine.results.put(StepResult(step.step_id, error=f"pipeline stage {self.stages_missing[0]} is gone"))
            return
        try:
            await self.link.send(self.stages[0], step, hidden)
        except Exception as exc:
            self.engine.results.put(StepResult(step.step_id, error=f"could not reach stage {self.stages[0]}: {exc!r}"))

    async def _take_results(self) -> None:
        while True:
            incoming = await self.link.next()
            message = incoming.message
            if message.head_boot_id != self.boot_id:
                continue  # for this head's previous process (its step ids meant other steps)
            if incoming.error is not None:
                result = StepResult(message.step_id, error=incoming.error)
            elif message.kind == "error":
                result = StepResult(message.step_id, error=message.error or "a stage failed the step")
            elif message.kind == "logits" and incoming.tensor is not None:
                result = StepResult(message.step_id, logits=incoming.tensor)
            else:
                result = StepResult(message.step_id, error=f"the head got a {message.kind!r} message")
            self.engine.results.put(result)

    # ---- stage health ---------------------------------------------------------------------------
    async def _watch_stages(self) -> None:
        readings = Readings(self.registry.ttl_s)  # a stage missing just after an outage is not taken for gone
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            try:
                entries = {info.instance_id: info for info in await self.registry.list()}
            except Exception as exc:  # NATS hiccup: look again next time
                readings.failed()
                log.warning("could not read the registry", error=repr(exc))
                continue
            was_missing = set(self.stages_missing)
            counted = readings.absences_count(time.monotonic())
            missing = [iid for iid in self.stages if iid not in entries and (counted or iid in was_missing)]
            new_boots = {iid: entries[iid].boot_id for iid in self.stages
                         if iid in entries and entries[iid].boot_id != self.stage_boot_ids.get(iid)}
            self.stages_missing = missing
            if missing and not was_missing:
                await self._reset(f"pipeline stage {missing[0]} is gone; its KV is lost")
            # A stage seen gone was reset for already; one that restarted unseen (within a heartbeat) was not.
            unseen = [iid for iid in new_boots if iid not in was_missing]
            if unseen:
                await self._reset(f"pipeline stage {unseen[0]} restarted; its KV is lost", new_boots)
            elif new_boots:
                await self.engine_loop.call(lambda engine: self.stage_boot_ids.update(new_boots))

    async def _reset(self, reason: str, new_boots: dict | None = None) -> None:
        """Fail every request and, in the same engine call (no step starts in between), take the stages'
        new boot ids: steps stamped with the old ones are refused by the restarted stages."""
        log.warning("pipeline reset", reason=reason)
        self.resets += 1

        def reset(engine):
            self.stage_boot_ids.update(new_boots or {})
            return engine.fail_all(reason)

        outputs = await self.engine_loop.call(reset)
        if outputs:
            self.on_reset(outputs)
