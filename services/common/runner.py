"""The life of every bus service: connect, build, run until told to stop (or crashed), drain."""

from collections.abc import Awaitable, Callable

from contracts import Subjects
from services.common.options import bus_credentials, bus_tls
from services.common.queues import join_deployment
from shared.bus.credentials import secured_bus
from services.common.service_settings import ServiceSettings
from services.common.startup_heap import freeze_startup_heap
from shared.bus.connection import ShutdownSignal, connect, drain
from shared.bus.permissions import inbox_prefix
from shared.bus.provision import ProvisionError, replicas_asked
from shared.bus.service import run_until_stopped
from shared.telemetry.logging import configure_logging, get_logger
from shared.telemetry.tracing import configure_tracing, shutdown_tracing


async def run_service(settings: ServiceSettings, role: str, build: Callable[..., Awaitable]) -> int:
    """`build(nc=, js=, registry=, subjects=, replicas=)` (`replicas`: for the JetStream streams it provisions)
    returns an object with `async start() -> tasks` and `async stop()`
    (and maybe `async drain()`, run on a shutdown signal before its tasks are cancelled).

    Exit code 0 after SIGTERM/SIGINT, 70 when one of the service's tasks crashed
    (so the supervisor restarts it).
    """
    configure_logging(role, settings.instance_id, settings.log_level)
    configure_tracing(role, settings.instance_id)
    log = get_logger(role)
    shutdown = ShutdownSignal()
    subjects = Subjects(settings.namespace)
    credentials = bus_credentials(settings)
    nc = await connect(settings.nats, name=settings.instance_id, credentials=credentials,
                       tls=bus_tls(settings), inbox_prefix=inbox_prefix(settings.namespace, role, settings.instance_id))
    js = nc.jetstream()
    try:
        replicas = replicas_asked(settings.nats_replicas, nc)
    except ProvisionError as exc:
        await nc.close()
        raise SystemExit(f"error: {exc}") from None
    registry = await join_deployment(js, subjects, replicas, may_provision=not secured_bus(settings.nats, credentials))
    service = await build(nc=nc, js=js, registry=registry, subjects=subjects, replicas=replicas)
    tasks = await service.start()
    if settings.status_port is not None:
        # Only here: its web framework is a third of a scheduler's start-up imports, and few deployments ask for it.
        from services.common.status_server import start_status_server

        tasks.append(await start_status_server(settings.status_host, settings.status_port, nc, service))
    freeze_startup_heap()
    log.info(f"{role} ready", instance_id=settings.instance_id)
    # A service with a `drain()` (a model worker) drains while its tasks still run.
    code = await run_until_stopped(*tasks, shutdown=shutdown, on_shutdown=getattr(service, "drain", None))
    await service.stop()
    await drain(nc)
    shutdown_tracing()
    return code
