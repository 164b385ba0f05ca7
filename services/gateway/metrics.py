"""The gateway's Prometheus series, and the one-stop view: every service's, asked for at the scrape."""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.service_metrics import StatsCollector
from services.gateway.service_stats import ScrapedStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class GatewayMetrics:
    """The request series are vLLM's where vLLM has the same measure (`vllm:`, labelled `model_name`: the model the
    request asked for), so that dashboards and endpoint pickers built for vLLM read them; every series also names
    its `service` and `instance`, in that order after `model_name`. A model's request series are its
    `ModelSeries` (`of_model`)."""

    def __init__(self, scrape_services, instance: str = "", models_now=lambda: ()):
        """`await scrape_services()` returns every other service's stats now (`ScrapedStats`, each entry's
        `served_model_name` the model it serves); `models_now()` each model served now as (name, its requests
        without a first token yet, the events dropped because their sender does not speak for their request)."""
        self._scrape_services = scrape_services
        self.registry = CollectorRegistry()
        self.service_labels = {"service": "gateway", "instance": instance}
        self.registry.register(_PerModel(self.service_labels, models_now))
        labels = ["model_name", *self.service_labels]

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        self.families = {
            "requests": counter("splitserve_requests", "Requests by endpoint and outcome", ("endpoint", "status")),
            "ttft": histogram("vllm:time_to_first_token_seconds", "Arrival to first token"),
            "itl": histogram("vllm:inter_token_latency_seconds", "Time between successive token chunks of a request"),
            "e2e": histogram("vllm:e2e_request_latency_seconds", "Arrival to last token"),
            "tpot": histogram("vllm:request_time_per_output_token_seconds",
                              "A request's mean time per output token after the first"),
            "prompt_tokens": histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request",
                                       TOKEN_BUCKETS),
            "generation_tokens": histogram("vllm:request_generation_tokens", "Tokens generated for each finished "
                                           "request", TOKEN_BUCKETS),
            "prompt_total": counter("vllm:prompt_tokens", "Prompt tokens of the finished requests"),
            "generation_total": counter("vllm:generation_tokens", "Tokens generated for the finished requests"),
            "success": counter("vllm:request_success", "Requests that finished, by why they stopped",
                               ("finished_reason",)),
            "migrations": counter("splitserve_request_migrations", "Requests moved to another worker, by the "
                                  "failure they moved on from", ("failure",)),
        }
        self._models: dict[str, ModelSeries] = {}  # one per model ever served (the operator's few)

    def of_model(self, model_name: str) -> "ModelSeries":
        series = self._models.get(model_name)
        if series is None:
            series = self._models[model_name] = ModelSeries(self.families,
                                                            {"model_name": model_name, **self.service_labels})
        return series

    async def exposition(self) -> bytes:
        """Prometheus text: this gateway's series, then every service's as it answers now."""
        scraped: ScrapedStats = await self._scrape_services()
        services = CollectorRegistry()
        services.register(StatsCollector(lambda: scraped.answered, by_model=True))
        services.register(_Answered(scraped))
        return generate_latest(self.registry) + generate_latest(services)


class ModelSeries:
    """One model's request series: the families' children labelled with its name and this gateway."""

    def __init__(self, families: dict, labels: dict[str, str]):
        self._families, self._labels = families, labels
        for key in ("ttft", "itl", "e2e", "tpot", "prompt_tokens", "generation_tokens", "prompt_total",
                    "generation_total"):
            setattr(self, key, families[key].labels(**labels))

    def request_ended(self, endpoint: str, status: str) -> None:
        self._families["requests"].labels(**self._labels, endpoint=endpoint, status=status).inc()

    def migrated(self, failure: str) -> None:
        self._families["migrations"].labels(**self._labels, failure=failure).inc()

    def observe_finished(self, arrived: float, first_token_at: float | None, usage: tuple[int, int, int] | None,
                         finish_reason: str | None, timed_tokens: int | None = None) -> None:
        """`timed_tokens`: the tokens of the completion whose first token `first_token_at` is (the first choice's,
        of n); all of `usage`'s by default."""
        now = time.monotonic()
        self.e2e.observe(now - arrived)
        prompt, completion = (usage[0], usage[1]) if usage else (0, 0)
        timed = completion if timed_tokens is None else timed_tokens
        if first_token_at is not None and timed > 1:
            self.tpot.observe((now - first_token_at) / (timed - 1))
        self.prompt_tokens.observe(prompt)
        self.generation_tokens.observe(completion)
        self.prompt_total.inc(prompt)
        self.generation_total.inc(completion)
        self._families["success"].labels(**self._labels, finished_reason=finish_reason or "unknown").inc()


class _Answered:
    """`splitserve_service_up`, as Prometheus' `up` is for its targets: which services this scrape heard from."""

    def __init__(self, scraped: ScrapedStats):
        self._scraped = scraped

    def collect(self):
        up = GaugeMetricFamily("splitserve_service_up", "1: the service in the registry answered this scrape's stats "
                               "request; 0: it did not, in time (its series are missing from this scrape)",
                               labels=["model_name", "service", "instance"])
        for answered, entries in ((1, self._scraped.answered), (0, self._scraped.silent)):
            for entry in entries:
                up.add_metric([entry.served_model_name, entry.role, entry.instance_id], answered)
        yield up


class _PerModel:
    """Each served model's figures that the gateway's own state holds: its requests without a first token yet
    (`splitserve_gateway_requests_waiting`) and `splitserve_gateway_forged_events_total`, token-stream events
    dropped because their sender is not the request's worker (or, before one is assigned, not a scheduler)."""

    def __init__(self, service_labels: dict[str, str], models_now):
        self._service_labels, self._models_now = service_labels, models_now

    def _families(self):
        labels = ["model_name", *self._service_labels]
        return (GaugeMetricFamily("splitserve_gateway_requests_waiting", "Requests at this gateway without a first "
                                  "token yet (what --max-waiting-requests bounds, for each model)", labels=labels),
                CounterMetricFamily("splitserve_gateway_forged_events", "Token-stream events dropped: their sender "
                                    "does not speak for the request", labels=labels))

    def describe(self):
        return self._families()

    def collect(self):
        waiting, forged = self._families()
        for name, num_waiting, num_forged in self._models_now():
            labels = [name, *self._service_labels.values()]
            waiting.add_metric(labels, num_waiting)
            forged.add_metric(labels, num_forged)
        yield waiting
        yield forged
