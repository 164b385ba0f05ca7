"""The Prometheus series a service's stats (`ServiceStats`) stand for: its engine, queues, transfers, caches,
routing and pipeline figures, labelled by service and instance (and model_name where vLLM has the measure).
"""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class StatsCollector:
    """Per-instance series from services' stats (`ServiceStats`), read as of the scrape: one service's own on its
    status endpoint, or every service's on the gateway's one-stop view."""

    def __init__(self, stats_snapshot):
        """`stats_snapshot()` returns the list of `ServiceStats` to show."""
        self._snapshot = stats_snapshot

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
            details = entry.details
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
