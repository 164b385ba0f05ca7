"""The gateway's Prometheus series, and the workers' state as the registry reports it."""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, services_snapshot):
        """`services_snapshot()` returns the latest registry entries (list of ServiceInfo)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("splitserve_requests", "Requests by endpoint and outcome", ["endpoint", "status"],
                                registry=self.registry)
        self.ttft = Histogram("splitserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("splitserve_inter_token_latency_seconds", "Time between streamed chunks",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_RegistryCollector(services_snapshot))


class _RegistryCollector:
    """Per-instance gauges from the heartbeated registry entries."""

    def __init__(self, services_snapshot):
        self._snapshot = services_snapshot

    def collect(self):
        fields = {
            "num_running": ("splitserve_num_requests_running", "Sequences in the running batch"),
            "num_waiting": ("splitserve_num_requests_waiting", "Sequences waiting to be scheduled"),
            "kv_blocks_total": ("splitserve_kv_blocks_total", "KV cache blocks"),
            "kv_blocks_free": ("splitserve_kv_blocks_free", "KV cache blocks free"),
        }
        families = {name: GaugeMetricFamily(metric, doc, labels=["service", "instance"])
                    for name, (metric, doc) in fields.items()}
        for entry in self._snapshot():
            if entry.role in ("gateway", "scheduler"):
                continue
            for name, family in families.items():
                family.add_metric([entry.role, entry.instance_id], getattr(entry, name))
        yield from families.values()
