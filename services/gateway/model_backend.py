"""One served model, as the gateway reaches it: what it knows of the model (`ModelInfo`), and its own connection
to the model's namespace, where the model's scheduler and workers live. Through it go the model's requests
(`RequestBus`) and their token streams (one subscription), its view of the registry (which workers are there,
how long a context they take, whether a request's worker is gone) and the stats of its services at a scrape.

The gateway holds one per served model (`Gateway.backends`); the front (HTTP, tenants, admission, metrics) is
the gateway's, shared by every model.
"""

import asyncio
import ssl
import time
from dataclasses import dataclass

from contracts import ServiceInfo, Subjects
from services.common.queues import join_deployment
from services.gateway.beats_seen import BeatsSeen
from services.gateway.errors import model_not_found
from services.gateway.metrics import ModelSeries
from services.gateway.model_info import ModelInfo
from services.gateway.request_bus import RequestBus
from services.gateway.service_stats import ScrapedStats, ask_every_service, labelled
from services.gateway.settings import GatewayServiceSettings
from services.gateway.streams import TokenStreams
from shared.bus.connection import connect, drain
from shared.bus.credentials import BusCredentials, secured_bus
from shared.bus.permissions import inbox_prefix
from shared.bus.provision import replicas_asked
from shared.bus.registry import Readings
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

REGISTRY_REFRESH_S = 1.0
_RELEASE_WAIT_S = 2.0  # after the wait for open streams: their readers' time to send the error event and let go


@dataclass(frozen=True)
class BusAccess:
    """How the gateway reaches NATS beyond its settings' URL: its credentials and TLS, read at start."""

    credentials: BusCredentials | None = None
    tls: ssl.SSLContext | None = None


class ModelBackend:
    def __init__(self, model: ModelInfo, namespace: str, settings: GatewayServiceSettings, bus: BusAccess,
                 series: ModelSeries):
        self.model = model
        self.namespace = namespace
        self.subjects = Subjects(namespace)
        self.settings, self.bus, self.series = settings, bus, series
        self.created_s = int(time.time())  # /v1/models' `created`
        self.streams = TokenStreams()
        self.services: list[ServiceInfo] = []  # the model namespace's registry, as last read
        self.beats = BeatsSeen()  # when each service process was last seen alive, on this gateway's clock
        self.closing = False  # unserved: new requests get 404, open ones finish
        self.nc = None
        self._watcher: asyncio.Task | None = None
        self._scraping: asyncio.Task | None = None  # the stats requests of the /metrics scrape in progress

    @property
    def name(self) -> str:
        return self.model.served_name

    async def start(self) -> None:
        """Connect to the model's namespace, follow its registry and take its token streams; a failure leaves no
        connection behind."""
        settings = self.settings
        self.nc = await connect(settings.nats, name=f"{settings.instance_id}/{self.name}",
                                credentials=self.bus.credentials, tls=self.bus.tls,
                                inbox_prefix=inbox_prefix(self.namespace, "gateway", settings.instance_id))
        try:
            replicas = replicas_asked(settings.nats_replicas, self.nc)
            self.registry = await join_deployment(self.nc.jetstream(), self.subjects, replicas,
                                                  may_provision=not secured_bus(settings.nats, self.bus.credentials))
            await self.nc.subscribe(self.subjects.tokens_wildcard(settings.instance_id), cb=self.streams.on_message)
            self.request_bus = RequestBus(nc=self.nc, subjects=self.subjects, gateway_id=settings.instance_id,
                                          streams=self.streams, migration_limit=settings.migration_limit,
                                          idle_timeout_s=settings.stream_idle_timeout, on_move=self.series.migrated,
                                          worker_alive_after=self.beats.alive_after)
            await self._refresh_services()
        except BaseException:
            await drain(self.nc)
            raise
        self._watcher = asyncio.create_task(self._watch_services())

    def check_open(self) -> None:
        """A new request may go to the model: not once it is unserved (404, as for a model never served)."""
        if self.closing:
            raise model_not_found(self.name)

    async def wait_streams(self, timeout_s: float, code: str, message: str) -> None:
        """Give the open requests `timeout_s` to finish, then end the rest with `code` (their readers send the
        error event and let go)."""
        deadline = time.monotonic() + timeout_s
        while len(self.streams) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if len(self.streams):
            log.warning("open requests ended", model=self.name, open_requests=len(self.streams), reason=code)
            self.streams.fail_all(code, message)
            deadline = time.monotonic() + _RELEASE_WAIT_S
            while len(self.streams) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop following the registry and close the connection (what is still open ends with an error first)."""
        self.closing = True
        self.streams.fail_all("shutting_down", f"the gateway no longer serves {self.name!r}")
        for task in (self._watcher, self._scraping):
            if task is not None:
                task.cancel()
        if self.nc is not None:
            await drain(self.nc)

    async def scrape(self) -> ScrapedStats:
        """The model's services' stats now, labelled with its name; scrapes that arrive while one is asking share
        its answers (so /metrics, often open, cannot be made to flood the bus)."""
        if self._scraping is None or self._scraping.done():
            entries = [e for e in self.services if e.role != "gateway"]
            self._scraping = asyncio.create_task(ask_every_service(self.nc, self.subjects, entries))
        return labelled(await asyncio.shield(self._scraping), self.name)

    @property
    def max_model_len(self) -> int:
        """The tightest context length among the model's workers (their --max-model-len), else the model's."""
        lengths = [e.max_model_len for e in self.services
                   if e.served_model_name == self.name and e.max_model_len > 0 and e.role != "gateway"]
        return min(lengths, default=self.model.max_model_len)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def _watch_services(self) -> None:
        readings = Readings(self.registry.ttl_s)  # a worker missing just after an outage is not taken for gone
        while True:
            await asyncio.sleep(REGISTRY_REFRESH_S)
            listed_at = time.monotonic()
            if not await self._refresh_services():
                readings.failed()
            elif readings.absences_count(listed_at):
                self.streams.fail_orphans(self.services, listed_at)

    async def _refresh_services(self) -> bool:
        try:
            read_at = time.monotonic()
            self.services = await self.registry.list()
            self.beats.read(self.services, read_at)
            return True
        except Exception as exc:
            log.warning("registry read failed", model=self.name, error=repr(exc))
            return False
