"""The gateway's per-tenant series, labelled by the request's model and the tenant's name (never by key).

Admission is the gateway's, across models: a tenant's limits count its requests to every model, and the series
split them by model (a tenant's in-flight requests are the sum over its models)."""

from prometheus_client import CollectorRegistry, Counter, Gauge


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, service_labels: dict[str, str]):
        """`service_labels`: this gateway's (service, instance), after each series' `model_name`."""
        labels = ["model_name", *service_labels]
        self._own = service_labels
        self._tokens = Counter("splitserve_tenant_tokens", "Tokens of a tenant's requests, as their responses' usage "
                               "reports them (prompt, completion)", [*labels, "tenant", "kind"], registry=registry)
        self._requests = Counter("splitserve_tenant_requests", "A tenant's admitted requests by outcome",
                                 [*labels, "tenant", "status"], registry=registry)
        self._in_flight = Gauge("splitserve_tenant_requests_in_flight", "A tenant's requests admitted and not "
                                "finished (what max_in_flight bounds, over every model)", [*labels, "tenant"],
                                registry=registry)
        self._rejected = Counter("splitserve_tenant_rejected", "A tenant's requests refused with 429, by the limit",
                                 [*labels, "tenant", "reason"], registry=registry)

    def admitted(self, model: str, tenant: str) -> None:
        self._in_flight.labels(model_name=model, **self._own, tenant=tenant).inc()

    def finished(self, model: str, tenant: str, status: str, prompt: int, completion: int) -> None:
        self._in_flight.labels(model_name=model, **self._own, tenant=tenant).dec()
        self._requests.labels(model_name=model, **self._own, tenant=tenant, status=status).inc()
        self._tokens.labels(model_name=model, **self._own, tenant=tenant, kind="prompt").inc(prompt)
        self._tokens.labels(model_name=model, **self._own, tenant=tenant, kind="completion").inc(completion)

    def rejected(self, model: str, tenant: str, reason: str) -> None:
        self._rejected.labels(model_name=model, **self._own, tenant=tenant, reason=reason).inc()
