"""The decode pipeline's head: stage 0, and the pipeline's face to the rest of the deployment.

To the scheduler and the gateway it is a worker like a colocated decode worker
(it takes `GenerateRequest`s and streams tokens: `DecodeWorker` does that
part). Inside, its engine is a `PipelineHeadEngine`: it runs the first layers
and the `PipelineDriver` carries each step through the stages, several
micro-batches in flight.
"""

import asyncio

from services.decode.worker import DecodeWorker
from services.stage.driver import PipelineDriver
from shared.telemetry.tracing import inject


class PipelineHead(DecodeWorker):
    def __init__(self, *, driver: PipelineDriver, **kwargs):
        super().__init__(mode="pipeline", **kwargs)
        self.driver = driver
        driver.attach(engine=self.engine, engine_loop=self.engine_loop, boot_id=self.identity.boot_id,
                      on_reset=self._outbox.put_nowait, trace_of=self._trace_of)

    def _trace_of(self, request_id: str) -> dict[str, str] | None:
        """The trace context of a request's span here, for the stages' spans of its prompt steps."""
        active = self.requests.get(request_id)
        return inject({}, active.span) if active is not None and active.span.is_recording() else None

    async def start(self) -> list[asyncio.Task]:
        driver_tasks = await self.driver.start()
        return [*await super().start(), *driver_tasks]

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        await super().stop(drain_timeout_s)
        await self.driver.stop()

    def info(self):
        info = super().info()
        info.details.update(self.driver.details())
        return info
