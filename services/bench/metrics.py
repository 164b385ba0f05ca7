"""Serving metrics from per-request timings, as `vllm bench serve` defines them (pure: no I/O).

Per request (times in seconds from a common origin): `sent`, the arrival of
each chunk that carried tokens (`chunk_times`), `end`, the output tokens the
server reported (`output_tokens`) and the prompt's (`prompt_tokens`).

- TTFT: first chunk - sent.
- TPOT: (end - first chunk) / (output tokens - 1), for requests with more than
  one output token.
- ITL: every gap between successive chunks, pooled over all requests.
- E2EL: end - sent.
- Throughput: completed requests, output tokens, and prompt + output tokens,
  each over the benchmark's duration.
- Goodput: completed requests per second that met every SLO given
  (TTFT <= --slo-ttft-ms, TPOT <= --slo-tpot-ms).
- SLO attainment: the share of all requests sent (failed ones count as misses)
  that met every SLO given (DistServe's metric).
"""

from dataclasses import dataclass, field


PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""  # the generated text, as streamed
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times) and self.end is not None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2el(self) -> float:
        return self.end - self.sent


def summary_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p95/p99 in milliseconds (linear interpolation, as numpy's percentile); None when empty."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    import numpy as np  # here: the module comes with every `splitserve` command's parser

    values = np.asarray(values_s, dtype=np.float64) * 1000
    return {"mean": float(values.mean()), **{f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}}


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether `record` completed within every SLO given (a request of one token has no TPOT to miss)."""
    return (record.ok and (slo_ttft_ms is None or record.ttft * 1000 <= slo_ttft_ms)
            and (slo_tpot_ms is None or record.tpot is None or record.tpot * 1000 <= slo_tpot_ms))


def compute_metrics(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> dict:
    """The benchmark's figures over `duration_s` (first send to last end)."""
    done = [r for r in records if r.ok]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    good = [r for r in done if meets_slo(r, slo_ttft_ms, slo_tpot_ms)]
    any_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    duration_s = max(duration_s, 1e-9)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "goodput": len(good) / duration_s if any_slo else None,
        "slo_attainment": len(good) / len(records) if any_slo and records else None,
        "ttft_ms": summary_ms([r.ttft for r in done]),
        "tpot_ms": summary_ms(tpots),
        "itl_ms": summary_ms([gap for r in done for gap in r.itls]),
        "e2el_ms": summary_ms([r.e2el for r in done]),
    }


def span_s(records: list[RequestRecord], until: float | None = None) -> float:
    """From the first send to the last data received (or `until` when nothing came back)."""
    ends = [r.end for r in records if r.end is not None]
    last = max(ends) if ends else (until if until is not None else max((r.sent for r in records), default=0.0))
    return last - min((r.sent for r in records), default=0.0)


def metrics_by_phase(phases: list[str], records: list[RequestRecord], slo_ttft_ms: float | None = None,
                     slo_tpot_ms: float | None = None) -> dict[str, dict]:
    """compute_metrics per phase (`phases[i]` labels `records[i]`), each over its own span, in first-seen order."""
    grouped: dict[str, list[RequestRecord]] = {}
    for phase, record in zip(phases, records):
        grouped.setdefault(phase, []).append(record)
    return {phase: compute_metrics(group, span_s(group), slo_ttft_ms, slo_tpot_ms) for phase, group in grouped.items()}
