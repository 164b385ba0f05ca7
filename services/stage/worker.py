"""A pipeline stage after the head: take steps in order, run this stage's layers, pass the result on.

The stage keeps no request state (see `shared/engine/stage.py`): each
`StageActivation` carries the step's batch and its route. The hidden states go
to the next stage on the route, the last stage's logits back to the head; a
step that fails here (its input did not arrive, its deadline passed, the
layers raised) is reported to the head, which ends that step's requests.
"""

import asyncio
import dataclasses
import time

from contracts import ServiceInfo, StatsRequest, Subjects
from services.common.identity import ServiceIdentity, now_ms
from services.stage.link import ActivationLink
from shared.telemetry.utilization import Utilization
from shared.bus.registry import Heartbeat, Registry
from shared.bus.subscribe import REJECTED, subscribe_typed
from shared.engine.stage import StageRunner
from shared.engine.step_batch import StepBatch
from shared.telemetry.logging import get_logger

log = get_logger(__name__)


class StageWorker:
    def __init__(self, *, nc, registry: Registry, subjects: Subjects, instance_id: str, runner: StageRunner,
                 link: ActivationLink, model: str, served_model_name: str):
        self.nc = nc
        self.registry = registry
        self.subjects = subjects
        self.instance_id = instance_id
        self.runner = runner
        self.link = link
        self.model = model
        self.served_model_name = served_model_name
        self.identity = ServiceIdentity(instance_id, "stage")
        self.state = "starting"
        self.utilization = Utilization()
        self.counts: dict[str, int] = {}
        self._heartbeat = Heartbeat(registry, self.info)

    async def start(self) -> list[asyncio.Task]:
        await self.link.start()
        await subscribe_typed(self.nc, self.subjects.stats(self.instance_id), StatsRequest, self._on_stats)
        self.state = "ready"
        self._heartbeat.start()
        return [asyncio.create_task(self._run(), name="stage-steps")]

    async def stop(self) -> None:
        self.state = "draining"
        await self.link.stop()
        await self.link.receiver.stop()
        self.link.sender.close()
        await self._heartbeat.stop(remove=True)

    def info(self) -> ServiceInfo:
        layers = self.runner.layer_range
        return self.identity.info(
            model=self.model, served_model_name=self.served_model_name, state=self.state,
            kv_blocks_total=self.runner.num_blocks, kv_blocks_free=self.runner.num_blocks,
            details={"layers": [layers.start, layers.end], "is_last": self.runner.is_last,
                     "parameter_bytes": self.runner.parameter_bytes, "block_size": self.runner.block_size,
                     "steps": dict(self.counts), "utilization": self.utilization.snapshot(),
                     "link": dict(self.link.stats), "rejected_messages": dict(REJECTED)},
        )

    async def _on_stats(self, _: StatsRequest, msg) -> None:
        if msg.reply:
            await msg.respond(self.info().encode())

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
            try:
                batch = StepBatch.from_dict(step.batch)
                started = time.monotonic()
                # One step at a time, in arrival order; the event loop keeps receiving the next ones meanwhile.
                output = await asyncio.to_thread(self.runner.execute, batch, incoming.tensor)
                self.utilization.record(started, time.monotonic())
            except Exception as exc:
                log.exception("stage step failed", step_id=step.step_id)
                self._count("failed")
                await self.link.fail_to_head(step, f"{self.instance_id} failed the step: {exc!r}")
                continue
            rest = step.route[1:]
            forward = dataclasses.replace(step, route=rest, kind="hidden" if rest else "logits", data=b"",
                                          transfer_id="")
            try:
                await self.link.send(rest[0] if rest else step.head, forward, output)
                self._count("forwarded")
            except Exception as exc:
                self._count("failed")
                await self.link.fail_to_head(step, f"{self.instance_id} could not pass the step on: {exc!r}")

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
