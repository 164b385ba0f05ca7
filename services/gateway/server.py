"""uvicorn, with a drain before it shuts down.

On the first SIGTERM or SIGINT the gateway drains (`Gateway.drain`): /ready
turns 503 so a load balancer stops sending, new requests get 503 with
Retry-After, and open streams have the drain timeout to finish before the
rest end with a final error event. Then uvicorn shuts down as usual. A second
signal skips what is left of the drain.
"""

import asyncio
import signal

import uvicorn

from services.gateway.gateway import Gateway
from shared.telemetry.logging import get_logger

log = get_logger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_timeout_s: float):
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler (signal.signal): it runs in the loop's thread, between two of its callbacks.
        if self._drain is None and self._loop is not None and self.started and not self.should_exit:
            self._captured_signals.append(sig)  # so uvicorn re-raises it once it has stopped, as it would
            self._drain = self._loop.create_task(self._drain_then_exit(signal.Signals(sig).name))
            return
        super().handle_exit(sig, frame)
        if self._drain is not None:
            self.force_exit = True  # the second signal: stop now

    async def _drain_then_exit(self, name: str) -> None:
        log.info("shutting down", signal=name, drain_timeout_s=self.drain_timeout_s)
        try:
            await self.gateway.drain(self.drain_timeout_s)
        finally:
            self.should_exit = True
