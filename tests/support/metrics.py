"""Reading a deployment's Prometheus /metrics in tests."""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(base_url: str) -> dict[str, list]:
    """Every sample of the gateway's /metrics by sample name; raises on anything that is not Prometheus text."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def matching(found, name: str, **labels) -> list[float]:
    """The values of the `name` samples carrying every one of `labels`."""
    return [s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]


def value(found, name: str, **labels) -> float:
    """The one sample of `name` with `labels` (asserts there is exactly one)."""
    values = matching(found, name, **labels)
    assert len(values) == 1, (name, labels, found.get(name))
    return values[0]
