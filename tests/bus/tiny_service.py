"""A minimal service main for the process tests: `python tiny_service.py NATS_URL BUCKET SUBJECT`.

It heartbeats into the registry, runs one task fed by a typed subscription
(a CancelRequest with request_id "crash" crashes it), prints "ready" on stdout
once started and "handled ID" after each cancel,
and exits the way every service does: `sys.exit(asyncio.run(main()))`.
"""

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import structlog  # noqa: E402

from contracts import CancelRequest, ServiceInfo  # noqa: E402
from shared.bus.connection import ShutdownSignal, connect, drain  # noqa: E402
from shared.bus.registry import Heartbeat, Registry  # noqa: E402
from shared.bus.service import run_until_stopped  # noqa: E402
from shared.bus.subscribe import subscribe_typed  # noqa: E402
from shared.telemetry.logging import configure_logging, get_logger  # noqa: E402

log = get_logger("tiny")


async def handle_cancels(mailbox: asyncio.Queue) -> None:
    """One message at a time; raising ends the task, and so the service (exit code 70)."""
    while True:
        msg = await mailbox.get()
        with structlog.contextvars.bound_contextvars(request_id=msg.request_id):
            log.info("handling cancel")
            if msg.request_id == "crash":
                raise RuntimeError("told to crash")
        print(f"handled {msg.request_id}", flush=True)


async def main(url: str, bucket: str, subject: str) -> int:
    configure_logging("tiny", "tiny-1")
    shutdown = ShutdownSignal()
    nc = await connect(url, name="tiny-1")
    registry = await Registry.open(nc.jetstream(), bucket, ttl_s=2.0)
    heartbeat = Heartbeat(registry, lambda: ServiceInfo(instance_id="tiny-1", role="test", state="ready"), interval_s=0.2)
    mailbox: asyncio.Queue = asyncio.Queue(maxsize=4)

    async def on_cancel(message: CancelRequest, msg) -> None:
        mailbox.put_nowait(message)

    await subscribe_typed(nc, subject, CancelRequest, on_cancel)
    tasks = [heartbeat.start(), asyncio.create_task(handle_cancels(mailbox), name="canceller")]
    await registry.put(ServiceInfo(instance_id="tiny-1", role="test", state="ready"))
    print("ready", flush=True)
    code = await run_until_stopped(*tasks, shutdown=shutdown)
    await heartbeat.stop(remove=True)
    await drain(nc)
    log.info("exiting", code=code)
    return code


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:4])))
