"""A pipeline stage after the head: take steps in order, run this stage's layers, pass the result on.

The stage keeps no request state (see `shared/engine/stage.py`): each
`StageActivation` carries the step's batch and its route. The hidden states go
to the next stage on the route, the last stage's logits back to the head; a
step that fails here (its input did not arrive, its deadline passed, the
layers raised) is reported to the head, which ends that step's requests.

In a prefill pipeline, a step also names the prompts it completes (`ship`):
the stage streams its own layers' KV of those prompts, layer by layer as it
computes them, straight to the decode worker's side channel (the ticket's
receiver takes each stage's layers over its own connection), and tells the
head when its part arrived (`KVShipped`).
"""

import asyncio
import time

import msgspec

from contracts import KVShipped, ServiceInfo, ServiceStats, StageActivation, StageShipment, StatsRequest, Subjects
from services.common.engine_thread import EngineThread
from services.common.identity import ServiceIdentity, now_ms
from services.stage.link import ActivationLink
from shared.telemetry.utilization import Utilization
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, subscribe_typed
from shared.engine import StageRunner, StepBatch
from shared.telemetry.logging import get_logger
from shared.telemetry.tracing import extract, tracer

log = get_logger(__name__)


class StageWorker:
    def __init__(self, *, nc, registry: Registry, subjects: Subjects, instance_id: str, runner: StageRunner,
                 engine_thread: EngineThread, link: ActivationLink, model: str, served_model_name: str,
                 kv_transport: str):
        self.nc = nc
        self.registry = registry
        self.subjects = subjects
        self.instance_id = instance_id
        self.runner = runner
        self.engine_thread = engine_thread  # the runner was built on it; every step runs on it
        self.link = link
        self.model = model
        self.served_model_name = served_model_name
        self.kv_transport = kv_transport
        self.shipments: set[asyncio.Task] = set()
        self.shipped: dict[str, int] = {}
        self.identity = ServiceIdentity(instance_id, "stage")
        self.state = "starting"
        self.utilization = Utilization()
        self.counts: dict[str, int] = {}
        self.heartbeat = Heartbeat(registry, self.info)

    async def start(self) -> list[asyncio.Task]:
        await self.link.start()
        await subscribe_typed(self.nc, self.subjects.stats(self.instance_id), StatsRequest, self._on_stats)
        self.state = "ready"
        self.heartbeat.start()
        return [asyncio.create_task(self._run(), name="stage-steps")]

    async def stop(self) -> None:
        self.state = "draining"
        for task in self.shipments:
            task.cancel()
        await asyncio.gather(*self.shipments, return_exceptions=True)
        await self.link.stop()
        await self.link.receiver.stop()
        self.link.sender.close()
        await self.heartbeat.stop(remove=True)

    def info(self) -> ServiceInfo:
        layers = self.runner.layer_range
        return self.identity.info(
            model=self.model, served_model_name=self.served_model_name, state=self.state,
            kv_blocks_total=self.runner.num_blocks, kv_blocks_free=self.runner.num_blocks,
            kv_block_size=self.runner.block_size, layer_range=(layers.start, layers.end))

    def stats(self) -> ServiceStats:
        return ServiceStats.of(self.info(), {
            "is_last": self.runner.is_last, "parameter_bytes": self.runner.parameter_bytes, "steps": dict(self.counts),
            "utilization": self.utilization.snapshot(), "link": dict(self.link.stats), "kv_shipped": dict(self.shipped),
            "kv_transfer": self.link.sender.stats.snapshot(), "rejected_messages": dict(REJECTED)})

    async def _on_stats(self, _: StatsRequest, msg) -> None:
        if msg.reply:
            await msg.respond(self.stats().encode())

    async def _run(self) -> None:
        while True:
            incoming = await self.link.next()
            step = incoming.message
            error = incoming.error
            if error is None and step.kind != "hidden":
                error = f"a stage takes hidden states, got a {step.kind!r} message"
            if error is None and step.deadline_ms < now_ms():
                error = "the step's deadline passed before it reached this stage"
            if error is None and (not step.route or step.route[0] != self.instance_id):
                error = f"the step's route {step.route} does not start at {self.instance_id}"
            expected_boot = step.stage_boot_ids.get(self.instance_id)
            if error is None and expected_boot is not None and expected_boot != self.identity.boot_id:
                error = "this stage restarted since the step's requests began: their KV here is lost"
            if error is not None:
                self._count("failed")
                await self.link.fail_to_head(step, f"{self.instance_id}: {error}")
                continue
            shipments = [self._start_shipment(step, entry) for entry in step.ship]
            try:
                batch = step.batch
                started, started_ns = time.monotonic(), time.time_ns()
                # One step at a time, in arrival order; the event loop keeps receiving the next ones meanwhile.
                output = await self.engine_thread.run(self.runner.execute, batch, incoming.tensor,
                                                      self._layer_shipper(shipments))
                self.utilization.record(started, time.monotonic())
                self._trace_prompt_chunks(step, batch, started_ns, time.time_ns())
            except Exception as exc:
                log.exception("stage step failed", step_id=step.step_id)
                self._count("failed")
                for shipment in shipments:
                    shipment.task.cancel()
                await self.link.fail_to_head(step, f"{self.instance_id} failed the step: {exc!r}")
                continue
            rest = step.route[1:]
            forward = msgspec.structs.replace(step, route=rest, kind="hidden" if rest else "logits", data=b"",
                                          transfer_id="")
            try:
                await self.link.send(rest[0] if rest else step.head, forward, output)
                self._count("forwarded")
            except Exception as exc:
                self._count("failed")
                await self.link.fail_to_head(step, f"{self.instance_id} could not pass the step on: {exc!r}")

    def _trace_prompt_chunks(self, step: StageActivation, batch: StepBatch, started_ns: int, ended_ns: int) -> None:
        """A span in each traced request's trace for this stage's share of the step computing its prompt."""
        layers = self.runner.layer_range
        for entry in step.traces:
            carrier = {"traceparent": entry.traceparent, "tracestate": entry.tracestate}
            span = tracer().start_span("stage.prefill_chunk", context=extract(carrier), start_time=started_ns,
                                       attributes={"splitserve.stage": self.instance_id, "splitserve.step_id": step.step_id,
                                                   "splitserve.layers": f"{layers.start}:{layers.end}",
                                                   "splitserve.request_id": entry.request_id,
                                                   "splitserve.prompt_tokens_in_step": entry.tokens,
                                                   "splitserve.step_tokens": batch.num_tokens})
            span.end(end_time=ended_ns)

    # ---- shipping a prompt's KV (prefill pipelines) ---------------------------------------------
    def _start_shipment(self, step: StageActivation, entry: StageShipment) -> "_Shipment":
        shipment = _Shipment(entry)
        shipment.task = asyncio.create_task(self._ship(step, shipment))
        self.shipments.add(shipment.task)
        shipment.task.add_done_callback(self.shipments.discard)
        return shipment

    def _layer_shipper(self, shipments: list["_Shipment"]):
        """The step's `after_layer` (on the compute thread): each shipment gets its layer's blocks, in place."""
        if not shipments:
            return None
        loop = asyncio.get_running_loop()

        def after_layer(layer: int) -> None:
            for shipment in shipments:
                try:
                    data, _ = self.runner.view_kv(shipment.block_ids, shipment.num_tokens, layer)
                except (ValueError, TypeError) as exc:
                    data = exc  # the shipment fails with it
                loop.call_soon_threadsafe(shipment.parts.put_nowait, (layer, layer + 1, data))

        return after_layer

    async def _ship(self, step: StageActivation, shipment: "_Shipment") -> None:
        layers = self.runner.layer_range

        async def layer_parts():
            for _ in range(layers.num_layers):
                layer_start, layer_end, data = await shipment.parts.get()
                if isinstance(data, Exception):
                    raise data
                yield layer_start, layer_end, data

        try:
            result = await self.link.sender.send(shipment.ticket, layer_parts(), backend=self.kv_transport,
                                                 layers=(layers.start, layers.end))
            ok, error, num_bytes = result.ok, result.error or "", result.num_bytes
        except asyncio.CancelledError:
            ok, error, num_bytes = False, "the step failed on this stage", 0
        except Exception as exc:
            ok, error, num_bytes = False, f"cannot ship: {exc!r}", 0
        outcome = "ok" if ok else "failed"
        self.shipped[outcome] = self.shipped.get(outcome, 0) + 1
        report = KVShipped(request_id=shipment.request_id, stage=self.instance_id, ok=ok, attempt=shipment.attempt,
                           num_bytes=num_bytes, error=error[:2000])
        try:
            await self.nc.publish(self.subjects.stage_shipped(step.head), report.encode())
        except Exception as exc:  # the head stops waiting at the transfer's deadline instead
            log.warning("could not report a shipment", request_id=shipment.request_id, error=repr(exc))

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1


class _Shipment:
    """One prompt's KV this stage ships: its blocks, the ticket, and its layers as they are computed."""

    def __init__(self, entry: StageShipment):
        self.request_id = entry.request_id
        self.ticket = entry.ticket
        self.attempt = entry.attempt
        self.block_ids = entry.block_ids
        self.num_tokens = entry.num_tokens
        self.parts: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

