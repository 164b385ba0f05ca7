"""The pipeline head: stage 0, and the pipeline's face to the rest of the deployment.

To the scheduler and the gateway it is a worker like a colocated decode worker
(it takes `GenerateRequest`s and streams tokens: `DecodeWorker` does that
part). Inside, its engine is a `PipelineHeadEngine`: it runs the first layers,
hands each step to the first stage through the `ActivationLink`, and gets the
logits back from the last one, with several micro-batches in flight.

It watches its stages in the registry. A stage that is gone, or came back
with a new boot id (an empty KV cache), makes every running request end with
an error at once (the KV they had at that stage is lost) and the cached
prefixes be forgotten; requests that arrive while a stage is gone are failed
the same way rather than left to wait.
"""

import asyncio

from contracts import StageActivation
from services.common.identity import now_ms
from services.decode.worker import DecodeWorker
from services.stage.link import ActivationLink
from shared.bus.registry import Registry
from shared.engine.pipeline import PipelineHeadEngine, StepResult
from shared.engine.step_batch import StepBatch
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

_WATCH_INTERVAL_S = 0.5


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


class PipelineHead(DecodeWorker):
    def __init__(self, *, link: ActivationLink, stages: list[str], stage_boot_ids: dict[str, str], **kwargs):
        super().__init__(mode="pipeline", **kwargs)
        self.link = link
        self.stages = stages
        self._stage_boot_ids = dict(stage_boot_ids)
        self._stages_missing: list[str] = []
        self._sends: set[asyncio.Task] = set()
        self.resets = 0

    async def start(self) -> list[asyncio.Task]:
        await self.link.start()
        tasks = await super().start()
        return [*tasks, asyncio.create_task(self._take_results(), name="pipeline-results"),
                asyncio.create_task(self._watch_stages(), name="pipeline-watch")]

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        await super().stop(drain_timeout_s)
        await self.link.stop()
        await self.link.receiver.stop()
        self.link.sender.close()

    def info(self):
        info = super().info()
        engine: PipelineHeadEngine = self.engine
        info.details.update({
            "layers": [0, engine.local_layers_end], "stages": list(self.stages),
            "microbatches": len(engine.schedulers), "steps_started": engine.steps_started,
            "steps_failed": engine.steps_failed, "steps_in_flight": engine.num_in_flight,
            "stages_missing": list(self._stages_missing), "resets": self.resets,
            "parameter_bytes": sum(r.loaded.parameter_bytes() for r in engine.executor.runners),
            "link": dict(self.link.stats), "utilization": engine.utilization.snapshot(),
        })
        return info

    # ---- steps out (from the engine thread) and results in ------------------------------------
    def submit(self, step_id: int, batch: StepBatch, hidden) -> None:
        """The engine's `submit`: called on the engine thread, right after the head's own layers."""
        self._loop.call_soon_threadsafe(self._send_step, step_id, batch, hidden)

    def _send_step(self, step_id: int, batch: StepBatch, hidden) -> None:
        step = StageActivation(step_id=step_id, head=self.instance_id, head_boot_id=self.identity.boot_id,
                               route=list(self.stages), batch=batch.to_dict(),
                               stage_boot_ids=dict(self._stage_boot_ids), kind="hidden",
                               deadline_ms=now_ms() + int(self.engine.step_timeout_s * 1000))
        task = asyncio.create_task(self._send(step, hidden))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(self, step: StageActivation, hidden) -> None:
        if self._stages_missing:
            self.engine.results.put(StepResult(step.step_id, error=f"pipeline stage {self._stages_missing[0]} is gone"))
            return
        try:
            await self.link.send(self.stages[0], step, hidden)
        except Exception as exc:
            self.engine.results.put(StepResult(step.step_id, error=f"could not reach stage {self.stages[0]}: {exc!r}"))

    async def _take_results(self) -> None:
        while True:
            incoming = await self.link.next()
            message = incoming.message
            if message.head_boot_id != self.identity.boot_id:
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
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            try:
                entries = {info.instance_id: info for info in await self.registry.list()}
            except Exception as exc:  # NATS hiccup: look again next time
                log.warning("could not read the registry", error=repr(exc))
                continue
            was_missing = set(self._stages_missing)
            missing = [iid for iid in self.stages if iid not in entries]
            restarted = [iid for iid in self.stages
                         if iid in entries and entries[iid].boot_id != self._stage_boot_ids.get(iid)]
            for iid in restarted:
                self._stage_boot_ids[iid] = entries[iid].boot_id
            self._stages_missing = missing
            if missing and not was_missing:
                await self._reset(f"pipeline stage {missing[0]} is gone; its KV is lost")
            # A stage seen gone was reset for already; one that restarted unseen (within a heartbeat) was not.
            unseen = [iid for iid in restarted if iid not in was_missing]
            if unseen:
                await self._reset(f"pipeline stage {unseen[0]} restarted; its KV is lost")

    async def _reset(self, reason: str) -> None:
        log.warning("pipeline reset", reason=reason)
        self.resets += 1
        outputs = await self.engine_loop.call(lambda engine: engine.fail_all(reason))
        if outputs:
            self._outbox.put_nowait(outputs)
