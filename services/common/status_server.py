"""A bus service's status endpoint (`--status-port`), for probes: Kubernetes', compose's health checks.

`GET /health` (liveness): 200 while the service's event loop answers and its NATS connection is not closed for
good. `GET /ready` (readiness): 200 while its registry entry is being kept (a heartbeat put went through within
the registry's TTL) and its state is "ready"; 503 with the reason otherwise (starting, draining, a pipeline head
waiting for a stage, NATS away). `GET /metrics`: the service's own series (Prometheus text), as of now rather than
its last heartbeat. Nothing else: no secret, no control.
"""

import asyncio
import contextlib

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.service_metrics import StatsCollector

from shared.telemetry.logging import get_logger

log = get_logger(__name__)


def liveness(nats_closed: bool) -> tuple[int, dict]:
    return (503, {"status": "failed", "nats": "closed"}) if nats_closed else (200, {"status": "ok"})


def readiness(state: str, heartbeat_fresh: bool) -> tuple[int, dict]:
    if state != "ready":
        return 503, {"status": "not_ready", "state": state}
    if not heartbeat_fresh:
        return 503, {"status": "not_ready", "state": state, "reason": "its registry entry is not being kept"}
    return 200, {"status": "ready", "state": state}


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the service's own handlers drain it; this server only answers probes
        yield


def status_app(nc, service) -> FastAPI:
    """`service` has `info()` (its registry entry, with `state`), `stats()` (its `ServiceStats`) and `heartbeat`
    (a `Heartbeat`)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health():
        code, body = liveness(nc.is_closed)
        return JSONResponse(body, status_code=code)

    @app.get("/ready")
    async def ready():
        code, body = readiness(service.info().state, service.heartbeat.fresh())
        return JSONResponse(body, status_code=code)

    own = CollectorRegistry()
    own.register(StatsCollector(lambda: [service.stats()]))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(own), media_type=CONTENT_TYPE_LATEST)

    return app


async def start_status_server(host: str, port: int, nc, service) -> asyncio.Task:
    """Serve the status endpoint until the returned task is cancelled."""
    server = _QuietServer(uvicorn.Config(status_app(nc, service), host=host, port=port, log_level="warning",
                                         access_log=False, lifespan="off"))

    async def serve():
        try:
            await server.serve()
        finally:
            server.should_exit = True

    task = asyncio.create_task(serve(), name="status-server")
    while not server.started:  # bound, or failed to bind (the task then ends with the error)
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    log.info("status endpoint listening", host=host, port=port)
    return task
