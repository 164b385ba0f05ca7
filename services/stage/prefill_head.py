"""The head of a pipelined prefill pool (`splitserve up --topology disagg --prefill-stages N`).

To the decode workers it is a prefill worker (it pulls `PrefillJob`s, samples
the first token, ships the prompt's KV: `PrefillRole` does that part), but
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
from services.common.engine_worker import EngineWorker
from services.common.identity import now_ms
from services.prefill.worker import PrefillRole
from services.stage.driver import PipelineDriver, Shipping

_DEADLINE_MARGIN_S = 1.0  # past the transfer's deadline, the decode worker applies nothing more


def prefill_pipeline_head(worker: EngineWorker, driver: PipelineDriver, **role_options) -> EngineWorker:
    """`worker` as a prefill pipeline's head: a prefill role whose jobs the stages ship too, and the driver."""
    shipments = PipelineShipments(worker, driver.stages)
    worker.role = PrefillRole(worker, stages=shipments, **role_options)
    worker.parts += [shipments, driver]
    driver.attach(engine=worker.engine, engine_loop=worker.engine_loop, boot_id=worker.identity.boot_id,
                  on_reset=worker.deliver, shipment_of=shipments.shipment_of, trace_of=worker.role.job_traces.get)
    return worker


class PipelineShipments:
    """The stages' reports (`KVShipped`) of the KV they shipped, per job attempt."""

    def __init__(self, worker: EngineWorker, stages: list[str]):
        self.worker = worker
        self.stages = stages
        self._shipments: dict[str, Shipping] = {}  # request id -> how its KV ships, while prefilling
        self._reports: dict[str, dict[str, asyncio.Future]] = {}  # request id -> stage -> its KVShipped

    async def start(self) -> list[asyncio.Task]:
        w = self.worker
        await w.subscribe(w.subjects.stage_shipped(w.instance_id), KVShipped, self._on_shipped)
        return []

    async def stop(self) -> None:
        pass

    def details(self) -> dict:
        return {}

    def waiting_for(self) -> str | None:
        return None  # the driver beside it says when a stage is gone

    def shipment_of(self, request_id: str) -> Shipping | None:
        """How the stages ship a request's KV (its ticket and attempt), for the steps the driver sends."""
        return self._shipments.get(request_id)

    def begin(self, job: PrefillJob) -> None:
        # A fresh attempt id: a late report of an earlier attempt at this job must not count for this one.
        loop = asyncio.get_running_loop()
        self._shipments[job.request_id] = Shipping(job.ticket, secrets.token_hex(8))
        self._reports[job.request_id] = {stage: loop.create_future() for stage in self.stages}

    async def shipped(self, job: PrefillJob) -> str | None:
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

    def end(self, job: PrefillJob) -> None:
        self._shipments.pop(job.request_id, None)
        for future in self._reports.pop(job.request_id, {}).values():
            future.cancel()

    async def _on_shipped(self, report: KVShipped, msg) -> None:
        shipment = self._shipments.get(report.request_id)
        if shipment is None or report.attempt != shipment.attempt:
            return  # an earlier attempt's
        future = self._reports.get(report.request_id, {}).get(report.stage)
        if future is not None and not future.done():
            future.set_result(report)
