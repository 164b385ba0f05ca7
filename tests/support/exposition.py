"""Prometheus exposition text built in tests: what a gateway's /metrics would show."""

GATEWAY = 'model_name="m",service="gateway",instance="gateway-0"'


def histogram(name: str, counts: dict[str, float], labels: str = GATEWAY) -> str:
    """A histogram's exposition: cumulative `counts` by upper bound (its last is +Inf)."""
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels},le="{le}"}} {n}' for le, n in counts.items()]
    total = list(counts.values())[-1]
    lines += [f"{name}_count{{{labels}}} {total}", f"{name}_sum{{{labels}}} 0"]
    return "\n".join(lines) + "\n"


def counter(name: str, values: dict[str, float]) -> str:
    """A counter family: each labels string -> its value."""
    return f"# TYPE {name} counter\n" + "".join(f"{name}_total{{{labels}}} {v}\n" for labels, v in values.items())


def gauge(name: str, values: dict[str, float]) -> str:
    return f"# TYPE {name} gauge\n" + "".join(f"{name}{{{labels}}} {v}\n" for labels, v in values.items())


def steps(instance: str, service: str = "decode", decode=(0, 0.0, 0), prompt=(0, 0.0, 0), prompt_tokens=0) -> str:
    """A worker's step counters: (steps, seconds, sequences) per kind, and its prompt tokens."""
    at = f'service="{service}",instance="{instance}"'
    kinds = {"decode": decode, "prompt": prompt}
    return (counter("splitserve_engine_steps", {f'{at},kind="{k}"': v[0] for k, v in kinds.items()})
            + counter("splitserve_engine_step_seconds", {f'{at},kind="{k}"': v[1] for k, v in kinds.items()})
            + counter("splitserve_engine_step_sequences", {f'{at},kind="{k}"': v[2] for k, v in kinds.items()})
            + counter("splitserve_engine_step_prompt_tokens", {at: prompt_tokens}))
