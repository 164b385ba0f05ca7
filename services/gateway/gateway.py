"""The state behind the HTTP handlers (one per process): the front every model shares (tenants, admission,
metrics, the gateway's own registry entry and the operator's model changes) and one `ModelBackend` per served
model, by its served name. A request goes to the backend its `model` names (`backend_for`); a name served by
none is OpenAI's 404 `model_not_found`.

The gateway's own connection is to the deployment's namespace (where its registry entry lives and the operator's
`ServeModel` arrives); each backend has its own, to its model's namespace (the first model's is the deployment's).
"""

import asyncio

from contracts import ServeModel, ServeModelReply, ServiceInfo, Subjects
from services.common.identity import ServiceIdentity
from services.common.queues import join_deployment
from services.gateway import readiness
from services.gateway.admission import Admission
from services.gateway.errors import model_not_found
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_backend import BusAccess, ModelBackend
from services.gateway.model_changes import change_refused, load_model_info
from services.gateway.model_info import ModelInfo, read_chat_template
from services.gateway.service_stats import ScrapedStats, merged
from services.gateway.settings import GatewayServiceSettings
from services.gateway.tenant_metrics import TenantMetrics
from services.gateway.tenants import TenantDirectory
from shared.bus.connection import connect, drain
from shared.bus.credentials import secured_bus
from shared.bus.permissions import inbox_prefix
from shared.bus.provision import replicas_asked
from shared.bus.registry import Heartbeat
from shared.bus.subscribe import subscribe_typed
from shared.telemetry.logging import get_logger

log = get_logger(__name__)


class Gateway:
    """`settings.model` is a model directory, as is each `--also-serve` model's (`__main__` resolves a model's
    name into its cached one); `run_dir` is the launcher's, whose deployment.json says which services it marked
    failed."""

    def __init__(self, settings: GatewayServiceSettings, bus: BusAccess | None = None, run_dir: str | None = None):
        self.settings = settings
        self.bus = bus or BusAccess()
        self.run_dir = run_dir
        self.subjects = Subjects(settings.namespace)
        self.backends: dict[str, ModelBackend] = {}  # served name -> backend, the first model first
        self.metrics = GatewayMetrics(self._scrape_services, settings.instance_id, self._model_figures)
        template = read_chat_template(settings.chat_template) if settings.chat_template else None
        self._add(self._backend(ModelInfo.load(settings.model, settings.served_model_name, template),
                                settings.namespace))
        for other in settings.also_serve:
            self._add(self._backend(ModelInfo.load(other.model, other.name), other.namespace))
        self.identity = ServiceIdentity(settings.instance_id, "gateway")
        self.tenants = TenantDirectory.of(settings.api_keys, settings.keys_file)
        # One tenant has nobody to be fair to: its requests go on as they come (a burst's prompts batch together).
        max_dispatched = settings.max_dispatched if self.tenants.tenants > 1 else 0
        self.admission = Admission(TenantMetrics(self.metrics.registry, self.metrics.service_labels),
                                   max_dispatched, settings.queue_timeout, settings.max_waiting_requests)
        self.draining = False
        self._background: set[asyncio.Task] = set()  # short-lived work (releases) that stop() lets finish
        self._changing = asyncio.Lock()  # one model change at a time
        self._leaving: tuple[ModelBackend, ...] = ()  # backends being unserved: their open requests still count

    def _backend(self, model: ModelInfo, namespace: str) -> ModelBackend:
        return ModelBackend(model, namespace, self.settings, self.bus, self.metrics.of_model(model.served_name))

    def _add(self, backend: ModelBackend) -> None:
        if backend.name in self.backends:
            raise ValueError(f"the served model name {backend.name!r} is given twice")
        self.backends[backend.name] = backend

    async def start(self) -> None:
        settings = self.settings
        self.nc = await connect(settings.nats, name=settings.instance_id, credentials=self.bus.credentials,
                                tls=self.bus.tls, inbox_prefix=inbox_prefix(settings.namespace, "gateway",
                                                                            settings.instance_id))
        self.registry = await join_deployment(self.nc.jetstream(), self.subjects,
                                              replicas_asked(settings.nats_replicas, self.nc),
                                              may_provision=not secured_bus(settings.nats, self.bus.credentials))
        for backend in self.backends.values():
            await backend.start()
        await subscribe_typed(self.nc, self.subjects.gateway_models(settings.instance_id), ServeModel,
                              self._on_model_change)
        self.heartbeat = Heartbeat(self.registry, self.info)
        self.heartbeat.start()

    def backend_for(self, name: str | None) -> ModelBackend:
        """The backend serving `name` (None: the first model served), or the 404 of a model not served."""
        if name is None:
            return next(iter(self.backends.values()))
        backend = self.backends.get(name)
        if backend is None:
            raise model_not_found(name)
        return backend

    def open_requests(self) -> int:
        return sum(len(b.streams) for b in self._every_backend())

    def _every_backend(self) -> list[ModelBackend]:
        return [*self.backends.values(), *self._leaving]

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting requests (503, and /ready says so), give the open ones `timeout_s` to finish, then
        end the rest with a final error event."""
        self.draining = True
        log.info("draining", open_requests=self.open_requests(), timeout_s=timeout_s)
        message = f"the gateway shut down before the request finished (it had {timeout_s:g} s); send it again"
        await asyncio.gather(*(b.wait_streams(timeout_s, "shutting_down", message) for b in self._every_backend()))

    async def stop(self) -> None:
        # Whatever the drain left (none, unless it was cut short) ends with an error now; cancels still go out.
        for backend in self._every_backend():
            backend.streams.fail_all("shutting_down", "the gateway is shutting down")
        if self._background:
            await asyncio.wait(set(self._background), timeout=2.0)
        for task in list(self._background):
            task.cancel()
        await self.heartbeat.stop(remove=True)
        await asyncio.gather(*(backend.close() for backend in self._every_backend()))
        await drain(self.nc)

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _scrape_services(self) -> ScrapedStats:
        """Every model's services' stats now, each labelled with its model."""
        return merged(await asyncio.gather(*(backend.scrape() for backend in self.backends.values())))

    def _model_figures(self) -> list[tuple[str, int, int]]:
        return [(b.name, b.streams.num_waiting(), b.streams.num_forged) for b in self.backends.values()]

    def info(self) -> ServiceInfo:
        return self.identity.info(
            model=self.settings.model, served_model_name=self.settings.served_model_name,
            state="draining" if self.draining else "ready",
            http_port=self.settings.port,
            active_requests=self.open_requests(),
        )

    # ---- the operator's model changes --------------------------------------------------
    async def _on_model_change(self, command: ServeModel, msg) -> None:
        async with self._changing:
            reply = await (self.serve(command) if command.serve else self.unserve(command.served_name))
        log.info("model change", served_name=command.served_name, serve=command.serve, ok=reply.ok, code=reply.code,
                 error=reply.error)
        if msg.reply:
            await msg.respond(reply.encode())

    def _reply(self, code: str = "", error: str = "") -> ServeModelReply:
        return ServeModelReply(ok=not code, models=list(self.backends), code=code, error=error)

    async def serve(self, command: ServeModel) -> ServeModelReply:
        """Start routing `command.served_name` to the pools in its namespace, once its model is read and its
        connection made; until then it is not listed (a request for it is a 404). A failure changes nothing."""
        refused = change_refused(command, self.backends, {b.namespace for b in self._every_backend()})
        if refused is not None:
            return self._reply(*refused)
        try:
            model = await load_model_info(command.model, command.served_name)
            backend = self._backend(model, command.namespace)
            await backend.start()
        except Exception as exc:  # a model that does not load, NATS refusing the namespace: said, nothing changes
            return self._reply("failed", f"{command.served_name!r} could not be served: {exc}")
        self.backends[backend.name] = backend
        return self._reply()

    async def unserve(self, name: str) -> ServeModelReply:
        """Stop routing `name`: new requests get 404 at once, the open ones have the drain timeout to finish, then
        its connection closes."""
        refused = change_refused(ServeModel(served_name=name, serve=False), self.backends, set())
        if refused is not None:
            return self._reply(*refused)
        backend = self.backends.pop(name)
        backend.closing = True
        self._leaving = (*self._leaving, backend)
        try:
            await backend.wait_streams(self.settings.drain_timeout, "shutting_down",
                                       f"the gateway stopped serving {name!r} before the request finished")
            await backend.close()
        finally:
            self._leaving = tuple(b for b in self._leaving if b is not backend)
        return self._reply()

    # ---- deployment state -------------------------------------------------------------
    def _judged(self) -> dict[str, dict]:
        """Each model's part of /ready: the first (in the deployment's namespace) by --expect, the others by what
        a request needs."""
        expect = readiness.expected(self.settings.expect, self.run_dir)
        return {name: readiness.judge_model(readiness.ready_counts(backend.services),
                                            expect if backend.namespace == self.settings.namespace
                                            else readiness.ANOTHER_MODEL_NEEDS, connected=backend.connected)
                for name, backend in self.backends.items()}

    def liveness(self) -> tuple[int, dict]:
        """/health: 200 unless the NATS connection is closed for good; what the deployment looks like."""
        nats = "closed" if self.nc.is_closed else "connected" if self.nc.is_connected else "reconnecting"
        models = self._judged()
        first = next(iter(models.values()))
        body = {"status": "ok" if nats != "closed" else "failed", "nats": nats, "draining": self.draining,
                "ready": first["ready"], "expected": first["expected"], "missing": first["missing"],
                "models": {name: model["missing"] for name, model in models.items()},
                "failed": readiness.launcher_failures(self.run_dir)}
        return (200 if nats != "closed" else 503), body

    def readiness(self) -> tuple[int, dict]:
        """/ready: whether a request can be served now, and for which model."""
        return readiness.judge_ready(self._judged(), connected=self.nc.is_connected, draining=self.draining)

