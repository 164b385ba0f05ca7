"""The Prometheus series a service's stats (`ServiceStats`) stand for: its engine, queues, transfers, caches,
routing and pipeline figures, labelled by service and instance (and model_name where vLLM has the measure, and
on every series at the gateway, which shows each model's services).
"""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

Gauge, Counter, Histogram = GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily
ENGINE = ["model_name", "service", "instance"]  # a model worker's engine series, labelled as vLLM's are
BY = ["service", "instance"]  # every other series

# key -> (family, name, help, labels), in the order a scrape shows them.
SERIES = {
    "num_running": (Gauge, "vllm:num_requests_running", "Sequences in the running batch", ENGINE),
    "num_waiting": (Gauge, "vllm:num_requests_waiting", "Sequences waiting to be scheduled", ENGINE),
    "kv_blocks_total": (Gauge, "splitserve_kv_blocks_total", "KV cache blocks", ENGINE),
    "kv_blocks_free": (Gauge, "splitserve_kv_blocks_free", "KV cache blocks free", ENGINE),
    "usage": (Gauge, "vllm:kv_cache_usage_perc", "Share of the KV cache blocks in use (1: all)", ENGINE),
    "transfer_bytes": (Counter, "splitserve_kv_transfer_bytes", "KV bytes received over the side channel",
                       [*BY, "backend"]),
    "transfer_seconds": (Histogram, "splitserve_kv_transfer_seconds", "Duration of KV transfers", BY),
    "decisions": (Counter, "splitserve_disagg_decisions", "Remote or local prefill, as the scheduler decided",
                  [*BY, "decision"]),
    "outcomes": (Counter, "splitserve_prefill_outcomes", "How a decode worker's requests were prefilled",
                 [*BY, "outcome"]),
    "idle": (Gauge, "splitserve_pipeline_stage_idle_fraction",
             "Share of a pipeline stage's time spent waiting for input while there was work "
             "(the bubble; gaps over 1 s count as no work)", BY),
    "busy": (Counter, "splitserve_pipeline_stage_busy_seconds", "Time a pipeline stage spent computing", BY),
    "idle_seconds": (Counter, "splitserve_pipeline_stage_idle_seconds",
                     "Time a pipeline stage waited for input between steps (gaps up to 1 s)", BY),
    "hop_bytes": (Counter, "splitserve_pipeline_activation_bytes",
                  "Activation bytes a pipeline stage sent on, inline on NATS or over the side channel",
                  [*BY, "path"]),
    "queue_depth": (Gauge, "splitserve_queue_depth", "Jobs waiting in a JetStream work queue, as the "
                    "scheduler last saw it", [*BY, "queue"]),
    "routed": (Counter, "splitserve_scheduler_routed", "Requests the scheduler handled, by outcome",
               [*BY, "outcome"]),
    "routed_blocks": (Counter, "splitserve_kv_router_blocks", "Prompt blocks of the requests the KV "
                      "router placed, and how many the chosen worker held", [*BY, "kind"]),
    "index_blocks": (Gauge, "splitserve_kv_router_index_blocks", "Block hashes in the scheduler's "
                     "prefix index", BY),
    "loan_events": (Counter, "splitserve_cpu_loan_events", "An idle prefill worker's CPUs lent to its "
                    "decode worker: lent, returned (at the lender's demand), claimed back, "
                    "overdue (claims that passed their deadline)", [*BY, "event"]),
    "loan_wait": (Counter, "splitserve_cpu_loan_claim_wait_seconds", "Time a prefill worker waited for "
                  "its lent CPUs back before computing", BY),
    "query_tokens": (Counter, "splitserve_prefix_cache_query_tokens",
                     "Prompt tokens a worker looked up in the prefix caches (full blocks)", BY),
    "hit_tokens": (Counter, "splitserve_prefix_cache_hit_tokens",
                   "Prompt tokens found cached: in the worker's own cache or in the kv-store", [*BY, "tier"]),
    "computed": (Counter, "splitserve_prompt_tokens_computed",
                 "Prompt tokens a worker ran through the model: not found in any cache (or computed again "
                 "after a preemption)", BY),
    "preemptions": (Counter, "splitserve_engine_preemptions", "Sequences a worker's engine preempted (they are "
                    "computed again later), by reason: kv_blocks (the cache ran short) or batch_share (the place "
                    "went to another tenant's or a higher priority's request)", [*BY, "reason"]),
    "steps": (Counter, "splitserve_engine_steps", "Engine steps a worker ran, by kind: prompt (it computed prompt "
              "tokens, maybe beside decodes) or decode", [*BY, "kind"]),
    "step_seconds": (Counter, "splitserve_engine_step_seconds", "Wall time of a worker's engine steps, by kind",
                     [*BY, "kind"]),
    "step_sequences": (Counter, "splitserve_engine_step_sequences", "Sequences given a token by a worker's engine "
                       "steps, by kind (per step: the batch a decode step ran)", [*BY, "kind"]),
    "step_prompt_tokens": (Counter, "splitserve_engine_step_prompt_tokens", "Prompt tokens a worker's engine steps "
                           "computed (prompt steps only)", BY),
    "store_bytes": (Gauge, "splitserve_kvstore_bytes", "KV bytes a kv-store holds, per tier", [*BY, "tier"]),
    "store_blocks": (Gauge, "splitserve_kvstore_blocks", "KV blocks a kv-store holds, per tier", [*BY, "tier"]),
    "store_evictions": (Counter, "splitserve_kvstore_evictions",
                        "Blocks a kv-store tier let go of (RAM: spilled to disk or dropped)", [*BY, "tier"]),
}
ENGINE_FIELDS = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free")  # ServiceInfo's own


class StatsCollector:
    """Per-instance series from services' stats (`ServiceStats`), read as of the scrape: one service's own on its
    status endpoint, or every service's on the gateway's one-stop view."""

    def __init__(self, stats_snapshot, by_model: bool = False):
        """`stats_snapshot()` returns the list of `ServiceStats` to show. `by_model`: every series, not only the
        engine's, leads with `model_name` (the entry's `served_model_name`): a gateway serving several models shows
        each model's services, whose instance names may repeat from one model to the next."""
        self._snapshot = stats_snapshot
        self._by_model = by_model

    def collect(self):
        by_model = self._by_model
        series = {key: family(name, doc, labels=labels if not by_model or labels[0] == "model_name"
                              else ["model_name", *labels])
                  for key, (family, name, doc, labels) in SERIES.items()}
        for entry in self._snapshot():
            labels = [*([entry.served_model_name] if by_model else []), entry.role, entry.instance_id]
            for decision, count in entry.details.get("disagg_decisions", {}).items():
                series["decisions"].add_metric([*labels, decision], count)
            if entry.role == "scheduler":
                _add_scheduler(series, labels, entry.details)
            if entry.role not in ("gateway", "scheduler"):
                _add_worker(series, labels, entry, by_model)
        yield from series.values()


def _add_scheduler(series: dict, labels: list[str], details: dict) -> None:
    for queue, depth in details.get("queue_depths", {}).items():
        series["queue_depth"].add_metric([*labels, queue], depth)
    for outcome, count in details.get("routed", {}).items():
        series["routed"].add_metric([*labels, outcome], count)
    hits = details.get("prefix_hits")
    if hits:
        series["routed_blocks"].add_metric([*labels, "prompt"], hits["prompt_blocks"])
        series["routed_blocks"].add_metric([*labels, "cached"], hits["cached_blocks"])
        series["index_blocks"].add_metric(labels, details["prefix_index"]["blocks"])


def _add_worker(series: dict, labels: list[str], entry, by_model: bool) -> None:
    """A model worker's, a pipeline stage's or a kv-store's series (`labels` lead with the model's name
    `by_model`)."""
    details = entry.details
    if entry.kv_blocks_total:  # a model worker (a kv-store has no engine)
        engine_labels = labels if by_model else [entry.served_model_name, *labels]
        for name in ENGINE_FIELDS:
            series[name].add_metric(engine_labels, getattr(entry, name))
        series["usage"].add_metric(engine_labels, 1 - entry.kv_blocks_free / entry.kv_blocks_total)
    for outcome, count in details.get("prefill_decisions", {}).items():
        series["outcomes"].add_metric([*labels, outcome], count)
    _add_transfer(series, labels, details.get("kv_transfer", {}))
    _add_prefix_cache(series, labels, details.get("prefix_cache"))
    for reason, count in details.get("preemptions", {}).items():
        series["preemptions"].add_metric([*labels, reason], count)
    store = details.get("store")
    if entry.role == "kvstore" and store:
        for tier in ("ram", "disk"):
            series["store_bytes"].add_metric([*labels, tier], store[tier]["bytes"])
            series["store_blocks"].add_metric([*labels, tier], store[tier]["blocks"])
            series["store_evictions"].add_metric([*labels, tier], store["evictions"][tier])
    _add_steps(series, labels, details.get("engine_steps"))  # (a stage's "steps" are its own counts)
    _add_pipeline(series, labels, details.get("utilization"), details.get("link"))
    _add_cpu_loan(series, labels, details.get("cpu_loan"))


def _add_transfer(series: dict, labels: list[str], transfer: dict) -> None:
    for backend, count in transfer.get("bytes_by_backend", {}).items():
        series["transfer_bytes"].add_metric([*labels, backend], count)
    histogram = transfer.get("seconds_histogram")
    if histogram:
        series["transfer_seconds"].add_metric(labels, [(str(le), n) for le, n in histogram["buckets"]],
                                              histogram["sum"])


def _add_prefix_cache(series: dict, labels: list[str], prefix: dict | None) -> None:
    if not prefix:
        return
    series["query_tokens"].add_metric(labels, prefix["query_tokens"])
    # Every worker shows the local and kv-store tiers (0 without a kv-store), and any other it reports.
    for tier, tokens in {"local": 0, "kvstore": 0, **prefix["hit_tokens"]}.items():
        series["hit_tokens"].add_metric([*labels, tier], tokens)
    series["computed"].add_metric(labels, prefix["prompt_tokens_computed"])


def _add_steps(series: dict, labels: list[str], steps: dict | None) -> None:
    if not steps:
        return
    for kind, counts in steps.items():
        series["steps"].add_metric([*labels, kind], counts["steps"])
        series["step_seconds"].add_metric([*labels, kind], counts["seconds"])
        series["step_sequences"].add_metric([*labels, kind], counts["sequences"])
    series["step_prompt_tokens"].add_metric(labels, steps.get("prompt", {}).get("prompt_tokens", 0))


def _add_pipeline(series: dict, labels: list[str], utilization: dict | None, link: dict | None) -> None:
    if utilization:
        series["idle"].add_metric(labels, utilization["idle_fraction"])
        series["busy"].add_metric(labels, utilization["busy_seconds"])
        series["idle_seconds"].add_metric(labels, utilization["idle_seconds"])
    if link:
        series["hop_bytes"].add_metric([*labels, "inline"], link.get("inline_bytes_sent", 0))
        series["hop_bytes"].add_metric([*labels, "side_channel"], link.get("side_channel_bytes_sent", 0))


def _add_cpu_loan(series: dict, labels: list[str], loan: dict | None) -> None:
    if not loan:
        return
    events = ("lent", "returned") if loan["role"] == "borrower" else ("claims", "overdue")
    for event in events:
        series["loan_events"].add_metric([*labels, event], loan[event])
    if loan["role"] == "lender":
        series["loan_wait"].add_metric(labels, loan["claim_wait_s"])
