"""The decode pipeline's head: stage 0, and the pipeline's face to the rest of the deployment.

To the scheduler and the gateway it is a worker like a colocated decode worker
(it takes `GenerateRequest`s and streams tokens: `DecodeRole` does that
part). Inside, its engine is a `PipelineHeadEngine`: it runs the first layers
and the `PipelineDriver` carries each step through the stages, several
micro-batches in flight.
"""

from services.common.engine_worker import EngineWorker
from services.common.settings import default_of
from services.decode.settings import DecodeSettings
from services.decode.worker import DecodeRole
from services.stage.driver import PipelineDriver


def decode_pipeline_head(worker: EngineWorker, driver: PipelineDriver, *, max_active_requests: int,
                         drain_timeout_s: float) -> EngineWorker:
    """`worker` as a decode pipeline's head: a decode role, and the driver that runs the stages."""
    # No remote prefill here (its timeout is never used).
    worker.role = DecodeRole(worker, mode="pipeline", max_active_requests=max_active_requests,
                             prefill_timeout_s=default_of(DecodeSettings, "prefill_timeout"),
                             drain_timeout_s=drain_timeout_s)
    worker.parts.append(driver)
    driver.attach(engine=worker.engine, engine_loop=worker.engine_loop, boot_id=worker.identity.boot_id,
                  on_reset=worker.deliver, trace_of=worker.role.trace_of)
    return worker
