"""The gateway's per-tenant series, labelled by tenant name (never by key)."""

from prometheus_client import CollectorRegistry, Counter, Gauge


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, own: dict[str, str]):
        labels = list(own)
        self._own = own
        self._tokens = Counter("splitserve_tenant_tokens", "Tokens of a tenant's requests, as their responses' usage "
                               "reports them (prompt, completion)", [*labels, "tenant", "kind"], registry=registry)
        self._requests = Counter("splitserve_tenant_requests", "A tenant's admitted requests by outcome",
                                 [*labels, "tenant", "status"], registry=registry)
        self._in_flight = Gauge("splitserve_tenant_requests_in_flight", "A tenant's requests admitted and not "
                                "finished (what max_in_flight bounds)", [*labels, "tenant"], registry=registry)
        self._rejected = Counter("splitserve_tenant_rejected", "A tenant's requests refused with 429, by the limit",
                                 [*labels, "tenant", "reason"], registry=registry)

    def admitted(self, tenant: str) -> None:
        self._in_flight.labels(**self._own, tenant=tenant).inc()

    def finished(self, tenant: str, status: str, prompt: int, completion: int) -> None:
        self._in_flight.labels(**self._own, tenant=tenant).dec()
        self._requests.labels(**self._own, tenant=tenant, status=status).inc()
        self._tokens.labels(**self._own, tenant=tenant, kind="prompt").inc(prompt)
        self._tokens.labels(**self._own, tenant=tenant, kind="completion").inc(completion)

    def rejected(self, tenant: str, reason: str) -> None:
        self._rejected.labels(**self._own, tenant=tenant, reason=reason).inc()
