"""The gateway's Prometheus series, and the workers' state as the registry reports it."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class GatewayMetrics:
    """The request series are vLLM's where vLLM has the same measure (`vllm:`, labelled `model_name`), so that
    dashboards and endpoint pickers built for vLLM read them; every series also names its `service` and
    `instance`."""

    def __init__(self, services_snapshot, num_waiting=lambda: 0, model_name: str = "", instance: str = ""):
        """`services_snapshot()` returns the latest registry entries (list of ServiceInfo); `num_waiting()` the
        gateway's requests without a first token yet; `model_name` and `instance` label this gateway's series."""
        self.registry = CollectorRegistry()
        own = {"model_name": model_name, "service": "gateway", "instance": instance}
        labels = list(own)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**own)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            family = Counter(name, doc, [*labels, *extra], registry=self.registry)
            return family if extra else family.labels(**own)

        self._own = own
        Gauge("splitserve_gateway_requests_waiting", "Requests at this gateway without a first token yet (what "
              "--max-waiting-requests bounds)", labels, registry=self.registry).labels(**own).set_function(num_waiting)
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
        self.registry.register(_RegistryCollector(services_snapshot))

    def request_ended(self, endpoint: str, status: str) -> None:
        self._requests.labels(**self._own, endpoint=endpoint, status=status).inc()

    def migrated(self, failure: str) -> None:
        self._migrations.labels(**self._own, failure=failure).inc()

    def observe_finished(self, arrived: float, first_token_at: float | None, usage: tuple[int, int, int] | None,
                         finish_reason: str | None) -> None:
        now = time.monotonic()
        self.e2e.observe(now - arrived)
        prompt, completion = (usage[0], usage[1]) if usage else (0, 0)
        if first_token_at is not None and completion > 1:
            self.tpot.observe((now - first_token_at) / (completion - 1))
        self.prompt_tokens.observe(prompt)
        self.generation_tokens.observe(completion)
        self.prompt_total.inc(prompt)
        self.generation_total.inc(completion)
        self._success.labels(**self._own, finished_reason=finish_reason or "unknown").inc()


class _RegistryCollector:
    """Per-instance gauges from the heartbeated registry entries."""

    def __init__(self, services_snapshot):
        self._snapshot = services_snapshot

    def collect(self):
        fields = {
            "num_running": ("vllm:num_requests_running", "Sequences in the running batch"),
            "num_waiting": ("vllm:num_requests_waiting", "Sequences waiting to be scheduled"),
            "kv_blocks_total": ("splitserve_kv_blocks_total", "KV cache blocks"),
            "kv_blocks_free": ("splitserve_kv_blocks_free", "KV cache blocks free"),
        }
        # A model worker's engine series, labelled as vLLM's are (model_name) and as every series here is.
        families = {name: GaugeMetricFamily(metric, doc, labels=["model_name", "service", "instance"])
                    for name, (metric, doc) in fields.items()}
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of the KV cache blocks in use (1: all)",
                                  labels=["model_name", "service", "instance"])
        transfer_bytes = CounterMetricFamily("splitserve_kv_transfer_bytes", "KV bytes received over the side channel",
                                             labels=["service", "instance", "backend"])
        transfer_seconds = HistogramMetricFamily("splitserve_kv_transfer_seconds", "Duration of KV transfers",
                                                 labels=["service", "instance"])
        decisions = CounterMetricFamily("splitserve_disagg_decisions", "Remote or local prefill, as the scheduler decided",
                                        labels=["service", "instance", "decision"])
        outcomes = CounterMetricFamily("splitserve_prefill_outcomes", "How a decode worker's requests were prefilled",
                                       labels=["service", "instance", "outcome"])
        idle = GaugeMetricFamily("splitserve_pipeline_stage_idle_fraction",
                                 "Share of a pipeline stage's time spent waiting for input while there was work "
                                 "(the bubble; gaps over 1 s count as no work)", labels=["service", "instance"])
        busy = CounterMetricFamily("splitserve_pipeline_stage_busy_seconds", "Time a pipeline stage spent computing",
                                   labels=["service", "instance"])
        idle_seconds = CounterMetricFamily("splitserve_pipeline_stage_idle_seconds",
                                           "Time a pipeline stage waited for input between steps (gaps up to 1 s)",
                                           labels=["service", "instance"])
        query_tokens = CounterMetricFamily("splitserve_prefix_cache_query_tokens",
                                           "Prompt tokens a worker looked up in the prefix caches (full blocks)",
                                           labels=["service", "instance"])
        hit_tokens = CounterMetricFamily("splitserve_prefix_cache_hit_tokens",
                                         "Prompt tokens found cached: in the worker's own cache or in the kv-store",
                                         labels=["service", "instance", "tier"])
        computed = CounterMetricFamily("splitserve_prompt_tokens_computed",
                                       "Prompt tokens a worker ran through the model: not found in any cache (or computed again "
                                       "after a preemption)",
                                       labels=["service", "instance"])
        store_bytes = GaugeMetricFamily("splitserve_kvstore_bytes", "KV bytes a kv-store holds, per tier",
                                        labels=["service", "instance", "tier"])
        store_blocks = GaugeMetricFamily("splitserve_kvstore_blocks", "KV blocks a kv-store holds, per tier",
                                         labels=["service", "instance", "tier"])
        store_evictions = CounterMetricFamily("splitserve_kvstore_evictions",
                                              "Blocks a kv-store tier let go of (RAM: spilled to disk or dropped)",
                                              labels=["service", "instance", "tier"])
        queue_depth = GaugeMetricFamily("splitserve_queue_depth", "Jobs waiting in a JetStream work queue, as the "
                                        "scheduler last saw it", labels=["service", "instance", "queue"])
        routed = CounterMetricFamily("splitserve_scheduler_routed", "Requests the scheduler handled, by outcome",
                                     labels=["service", "instance", "outcome"])
        routed_blocks = CounterMetricFamily("splitserve_kv_router_blocks", "Prompt blocks of the requests the KV "
                                            "router placed, and how many the chosen worker held",
                                            labels=["service", "instance", "kind"])
        index_blocks = GaugeMetricFamily("splitserve_kv_router_index_blocks", "Block hashes in the scheduler's "
                                         "prefix index", labels=["service", "instance"])
        hop_bytes = CounterMetricFamily("splitserve_pipeline_activation_bytes",
                                        "Activation bytes a pipeline stage sent on, inline on NATS or over the side channel",
                                        labels=["service", "instance", "path"])
        loan_events = CounterMetricFamily("splitserve_cpu_loan_events", "An idle prefill worker's CPUs lent to its "
                                          "decode worker: lent, returned (at the lender's demand), claimed back, "
                                          "overdue (claims that passed their deadline)",
                                          labels=["service", "instance", "event"])
        loan_wait = CounterMetricFamily("splitserve_cpu_loan_claim_wait_seconds", "Time a prefill worker waited for "
                                        "its lent CPUs back before computing", labels=["service", "instance"])
        for entry in self._snapshot():
            labels = [entry.role, entry.instance_id]
            details = entry.details or {}
            for decision, count in details.get("disagg_decisions", {}).items():
                decisions.add_metric([*labels, decision], count)
            if entry.role == "scheduler":
                for queue, depth in details.get("queue_depths", {}).items():
                    queue_depth.add_metric([*labels, queue], depth)
                for outcome, count in details.get("routed", {}).items():
                    routed.add_metric([*labels, outcome], count)
                hits = details.get("prefix_hits")
                if hits:
                    routed_blocks.add_metric([*labels, "prompt"], hits["prompt_blocks"])
                    routed_blocks.add_metric([*labels, "cached"], hits["cached_blocks"])
                    index_blocks.add_metric(labels, details["prefix_index"]["blocks"])
            if entry.role in ("gateway", "scheduler"):
                continue
            if entry.kv_blocks_total:  # a model worker (a kv-store has no engine)
                engine_labels = [entry.served_model_name, *labels]
                for name, family in families.items():
                    family.add_metric(engine_labels, getattr(entry, name))
                usage.add_metric(engine_labels, 1 - entry.kv_blocks_free / entry.kv_blocks_total)
            for outcome, count in details.get("prefill_decisions", {}).items():
                outcomes.add_metric([*labels, outcome], count)
            transfer = details.get("kv_transfer", {})
            for backend, count in transfer.get("bytes_by_backend", {}).items():
                transfer_bytes.add_metric([*labels, backend], count)
            prefix = details.get("prefix_cache")
            if prefix:
                query_tokens.add_metric(labels, prefix["query_tokens"])
                # Every worker shows the local and kv-store tiers (0 without a kv-store), and any other it reports.
                for tier, tokens in {"local": 0, "kvstore": 0, **prefix["hit_tokens"]}.items():
                    hit_tokens.add_metric([*labels, tier], tokens)
                computed.add_metric(labels, prefix["prompt_tokens_computed"])
            store = details.get("store")
            if entry.role == "kvstore" and store:
                for tier in ("ram", "disk"):
                    store_bytes.add_metric([*labels, tier], store[tier]["bytes"])
                    store_blocks.add_metric([*labels, tier], store[tier]["blocks"])
                    store_evictions.add_metric([*labels, tier], store["evictions"][tier])
            utilization = details.get("utilization")
            if utilization:
                idle.add_metric(labels, utilization["idle_fraction"])
                busy.add_metric(labels, utilization["busy_seconds"])
                idle_seconds.add_metric(labels, utilization["idle_seconds"])
            link = details.get("link")
            if link:
                hop_bytes.add_metric([*labels, "inline"], link.get("inline_bytes_sent", 0))
                hop_bytes.add_metric([*labels, "side_channel"], link.get("side_channel_bytes_sent", 0))
            loan = details.get("cpu_loan")
            if loan:
                events = ("lent", "returned") if loan["role"] == "borrower" else ("claims", "overdue")
                for event in events:
                    loan_events.add_metric([*labels, event], loan[event])
                if loan["role"] == "lender":
                    loan_wait.add_metric(labels, loan["claim_wait_s"])
            histogram = transfer.get("seconds_histogram")
            if histogram:
                transfer_seconds.add_metric(labels, [(str(le), n) for le, n in histogram["buckets"]], histogram["sum"])
        yield from families.values()
        yield from (usage, transfer_bytes, transfer_seconds, decisions, outcomes, idle, busy, idle_seconds, hop_bytes,
                    queue_depth, routed, routed_blocks, index_blocks, loan_events, loan_wait,
                    query_tokens, hit_tokens, computed, store_bytes, store_blocks, store_evictions)
