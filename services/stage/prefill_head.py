"""The head of a pipelined prefill pool (`splitserve up --topology disagg --prefill-stages N`).

To the decode workers it is a prefill worker (it pulls `PrefillJob`s, samples
the first token, ships the prompt's KV: `PrefillWorker` does that part), but
its engine runs only the first layers; the `PipelineDriver` carries each step
through the stages. The KV goes to the decode worker from every stage at once:
the head ships its own layers, each stage its own (the steps that complete a
prompt name it and its ticket), each over its own connection to the decode
worker's side channel. The job is acked once every stage has reported its
part delivered; the prompt's blocks are kept until then (or until the
transfer's deadline, after which the decode worker reads nothing more).
"""

import asyncio
import secrets

from contracts import KVShipped, PrefillJob
from services.common.identity import now_ms
from services.prefill.worker import PrefillWorker
from services.stage.driver import PipelineDriver
from shared.bus.subscribe import subscribe_typed

_DEADLINE_MARGIN_S = 1.0  # past the transfer's deadline, the decode worker applies nothing more


class PrefillPipelineHead(PrefillWorker):
    def __init__(self, *, driver: PipelineDriver, **kwargs):
        super().__init__(**kwargs)
        self.driver = driver
        self._shipments: dict[str, dict] = {}  # request id -> {ticket, attempt}, while prefilling
        self._reports: dict[str, dict[str, asyncio.Future]] = {}  # request id -> stage -> its KVShipped
        driver.attach(engine=self.engine, engine_loop=self.engine_loop, boot_id=self.identity.boot_id,
                      on_reset=self._deliver, shipment_of=self._shipments.get, trace_of=self.job_traces.get)

    async def start(self) -> list[asyncio.Task]:
        driver_tasks = await self.driver.start()
        await subscribe_typed(self.nc, self.subjects.stage_shipped(self.instance_id), KVShipped, self._on_shipped)
        return [*await super().start(), *driver_tasks]

    async def stop(self) -> None:
        await super().stop()
        await self.driver.stop()

    def info(self):
        info = super().info()
        info.details.update(self.driver.details())
        return info

    @property
    def shipped_layers(self) -> tuple[int, int]:
        return 0, self.engine.local_layers_end

    def _job_started(self, job: PrefillJob) -> None:
        # A fresh attempt id: a late report of an earlier attempt at this job must not count for this one.
        self._shipments[job.request_id] = {"ticket": job.ticket, "attempt": secrets.token_hex(8)}
        self._reports[job.request_id] = {stage: self._loop.create_future() for stage in self.driver.stages}

    async def _others_shipped(self, job: PrefillJob) -> str | None:
        reports = self._reports.get(job.request_id, {})
        if not reports:
            return None
        remaining_s = max(0.0, (job.deadline_ms - now_ms()) / 1000)
        done, pending = await asyncio.wait(reports.values(), timeout=remaining_s + _DEADLINE_MARGIN_S)
        if pending:
            missing = [stage for stage, future in reports.items() if future in pending]
            return f"no word from stage {missing[0]} by the transfer's deadline"
        for stage, future in reports.items():
            report = future.result()
            if not report.ok:
                return f"stage {stage} could not ship its layers: {report.error}"
        return None

    def _job_ended(self, job: PrefillJob) -> None:
        self._shipments.pop(job.request_id, None)
        for future in self._reports.pop(job.request_id, {}).values():
            future.cancel()

    async def _on_shipped(self, report: KVShipped, msg) -> None:
        shipment = self._shipments.get(report.request_id)
        if shipment is None or report.attempt != shipment["attempt"]:
            return  # an earlier attempt's
        future = self._reports.get(report.request_id, {}).get(report.stage)
        if future is not None and not future.done():
            future.set_result(report)
