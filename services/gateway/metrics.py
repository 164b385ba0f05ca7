"""The gateway's Prometheus series, and the one-stop view: every service's, asked for at the scrape."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.service_metrics import StatsCollector
from services.gateway.service_stats import ScrapedStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class GatewayMetrics:
    """The request series are vLLM's where vLLM has the same measure (`vllm:`, labelled `model_name`), so that
    dashboards and endpoint pickers built for vLLM read them; every series also names its `service` and
    `instance`."""

    def __init__(self, scrape_services, num_waiting=lambda: 0, model_name: str = "", instance: str = "",
                 num_forged=lambda: 0):
        """`await scrape_services()` returns every other service's stats now (`ScrapedStats`); `num_waiting()` the
        gateway's requests without a first token yet; `num_forged()` the events it dropped because their sender
        does not speak for their request; `model_name` and `instance` label this gateway's series."""
        self._scrape_services = scrape_services
        self.registry = CollectorRegistry()
        own = {"model_name": model_name, "service": "gateway", "instance": instance}
        labels = list(own)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**own)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            family = Counter(name, doc, [*labels, *extra], registry=self.registry)
            return family if extra else family.labels(**own)

        self._own = own
        self.own_labels = own
        Gauge("splitserve_gateway_requests_waiting", "Requests at this gateway without a first token yet (what "
              "--max-waiting-requests bounds)", labels, registry=self.registry).labels(**own).set_function(num_waiting)
        self.registry.register(_ForgedEvents(own, num_forged))
        self._requests = counter("splitserve_requests", "Requests by endpoint and outcome", ("endpoint", "status"))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between successive token chunks of a request")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "A request's mean time per output token after the first")
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request",
                                       TOKEN_BUCKETS)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Tokens generated for each finished "
                                           "request", TOKEN_BUCKETS)
        self.prompt_total = counter("vllm:prompt_tokens", "Prompt tokens of the finished requests")
        self.generation_total = counter("vllm:generation_tokens", "Tokens generated for the finished requests")
        self._success = counter("vllm:request_success", "Requests that finished, by why they stopped",
                                ("finished_reason",))
        self._migrations = counter("splitserve_request_migrations", "Requests moved to another worker, by the "
                                   "failure they moved on from", ("failure",))

    async def exposition(self) -> bytes:
        """Prometheus text: this gateway's series, then every service's as it answers now."""
        scraped: ScrapedStats = await self._scrape_services()
        services = CollectorRegistry()
        services.register(StatsCollector(lambda: scraped.answered))
        services.register(_Answered(scraped))
        return generate_latest(self.registry) + generate_latest(services)

    def request_ended(self, endpoint: str, status: str) -> None:
        self._requests.labels(**self._own, endpoint=endpoint, status=status).inc()

    def migrated(self, failure: str) -> None:
        self._migrations.labels(**self._own, failure=failure).inc()

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
        self._success.labels(**self._own, finished_reason=finish_reason or "unknown").inc()


class _Answered:
    """`splitserve_service_up`, as Prometheus' `up` is for its targets: which services this scrape heard from."""

    def __init__(self, scraped: ScrapedStats):
        self._scraped = scraped

    def collect(self):
        up = GaugeMetricFamily("splitserve_service_up", "1: the service in the registry answered this scrape's stats "
                               "request; 0: it did not, in time (its series are missing from this scrape)",
                               labels=["service", "instance"])
        for answered, entries in ((1, self._scraped.answered), (0, self._scraped.silent)):
            for entry in entries:
                up.add_metric([entry.role, entry.instance_id], answered)
        yield up


class _ForgedEvents:
    """`splitserve_gateway_forged_events_total`: token-stream events dropped because their sender is not the
    request's worker (or, before one is assigned, not a scheduler)."""

    def __init__(self, labels: dict[str, str], count):
        self._labels, self._count = labels, count

    def collect(self):
        family = CounterMetricFamily("splitserve_gateway_forged_events", "Token-stream events dropped: their sender "
                                     "does not speak for the request", labels=list(self._labels))
        family.add_metric(list(self._labels.values()), self._count())
        yield family
