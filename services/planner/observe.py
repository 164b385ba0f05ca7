"""What the pools did over a window, from two scrapes of the gateway's /metrics taken `window_s` apart: the
planner's `Observation`. Pure: text in, figures out; what must outlive a window (the step-time fit's points, the
last measured prefill capacity and prompt size) is carried in a `History` the caller hands back each time.

Which series (every one on the gateway's one-stop /metrics):
- TTFT and ITL p90: the gateway's `vllm:time_to_first_token_seconds` and `vllm:inter_token_latency_seconds`
  histograms, their buckets' increase over the window, interpolated as Prometheus' histogram_quantile does;
- the decode fit: per decode worker, its decode steps' mean sequences and mean milliseconds over the window
  (`splitserve_engine_step*_total{kind="decode"}`), one point each, least squares over the last FIT_POINTS;
- the prefill pool's capacity: its workers' prompt tokens over their prompt steps' busy seconds;
- prompt tokens arriving: what the prefill workers computed, plus what their queue grew by;
- running sequences: the decode workers' `vllm:num_requests_running` now.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from services.planner.policy import DecodePool, Observation, PrefillPool

QUANTILE = 0.9
FIT_POINTS = 32  # the decode fit's memory: the most recent (sequences, ms) points
MIN_STEPS = 3  # a worker's window counts as a fit point once it ran this many decode steps
MIN_SPREAD = 0.5  # sequences per step the points must spread over before a slope means anything
MIN_BUSY_S = 0.05  # prompt-step seconds a window needs before its capacity is believed

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"

Labels = tuple[tuple[str, str], ...]
Scrape = dict[str, dict[Labels, float]]  # sample name -> {sorted labels: value}


def parse(text: str, model_name: str | None = None) -> Scrape:
    """Prometheus text -> every sample by name and label set; with `model_name`, only the samples of that model
    (a deployment serving several models labels each series with its `model_name`) and those of no model."""
    scrape: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if model_name is not None and sample.labels.get("model_name", model_name) != model_name:
                continue
            scrape.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return scrape


def _matching(scrape: Scrape, name: str, where: dict[str, str]) -> dict[Labels, float]:
    return {labels: value for labels, value in scrape.get(name, {}).items()
            if all(dict(labels).get(k) == v for k, v in where.items())}


def total(scrape: Scrape, name: str, **where: str) -> float:
    """The sum of `name`'s samples carrying `where`'s labels."""
    return sum(_matching(scrape, name, where).values())


def increases(before: Scrape, after: Scrape, name: str, **where: str) -> dict[Labels, float]:
    """Each matching counter's increase over the window; a series that went down restarted (its process did),
    so its increase is all it counts now, as Prometheus' increase() takes it. A series new in `after` counts
    from 0."""
    old = _matching(before, name, where)
    return {labels: value - old.get(labels, 0.0) if value >= old.get(labels, 0.0) else value
            for labels, value in _matching(after, name, where).items()}


def increase(before: Scrape, after: Scrape, name: str, **where: str) -> float:
    return sum(increases(before, after, name, **where).values())


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative buckets (upper bound, count), as Prometheus' histogram_quantile: linear within
    the bucket the rank falls in (the first from 0), the highest finite bound where it falls in +Inf; None
    without a sample."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def window_quantile(before: Scrape, after: Scrape, family: str, q: float = QUANTILE, **where: str) -> float | None:
    """The q-quantile of what a histogram counted in the window, over every series matching `where`."""
    by_bound: dict[float, float] = {}
    for labels, count in increases(before, after, f"{family}_bucket", **where).items():
        bound = float(dict(labels)["le"])
        by_bound[bound] = by_bound.get(bound, 0.0) + count
    return histogram_quantile(q, by_bound.items())


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _by_instance(found: dict[Labels, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in found.items():
        instance = dict(labels).get("instance", "")
        out[instance] = out.get(instance, 0.0) + value
    return out


def step_points(before: Scrape, after: Scrape, service: str = "decode") -> list[tuple[float, float]]:
    """Per worker of `service`: (mean sequences per decode step, mean ms per decode step) over the window, for
    each that ran at least MIN_STEPS."""
    where = {"service": service, "kind": "decode"}
    steps = _by_instance(increases(before, after, "splitserve_engine_steps_total", **where))
    seconds = _by_instance(increases(before, after, "splitserve_engine_step_seconds_total", **where))
    sequences = _by_instance(increases(before, after, "splitserve_engine_step_sequences_total", **where))
    return [(sequences.get(name, 0.0) / n, 1000 * seconds.get(name, 0.0) / n)
            for name, n in sorted(steps.items()) if n >= MIN_STEPS]


def fit_step_time(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(fixed ms, ms per sequence) of the least-squares line through the points; (0, 0), not measured, until
    they spread over MIN_SPREAD sequences. The slope is at least 0 and the fixed part positive: a step never
    costs less for more sequences."""
    points = list(points)
    if len(points) < 2:
        return 0.0, 0.0
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if max(xs) - min(xs) < MIN_SPREAD:
        return 0.0, 0.0
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x in xs))
    slope = max(slope, 0.0)
    return max(mean_y - slope * mean_x, 1e-3), slope


def prefill_capacity(before: Scrape, after: Scrape, service: str = "prefill") -> float | None:
    """Prompt tokens a busy `service` worker computes per second, over the window; None where they were not busy
    long enough to say."""
    busy = increase(before, after, "splitserve_engine_step_seconds_total", service=service, kind="prompt")
    if busy < MIN_BUSY_S:
        return None
    return increase(before, after, "splitserve_engine_step_prompt_tokens_total", service=service) / busy


def queued_requests(scrape: Scrape) -> float:
    """Prompts waiting for the prefill pool: on its workers, and in the prefill queue as the scheduler saw it."""
    return (total(scrape, "vllm:num_requests_waiting", service="prefill")
            + total(scrape, "splitserve_queue_depth", service="scheduler", queue="prefill"))


def mean_prompt_tokens(before: Scrape, after: Scrape, prefill_workers: int) -> float | None:
    """Uncached tokens of a prompt over the window: the prefill pool's computed tokens per remote prefill (a
    colocated deployment's: every worker's per first token); None without a prompt."""
    computed = "splitserve_prompt_tokens_computed_total"
    if prefill_workers:
        prompts = increase(before, after, "splitserve_disagg_decisions_total", decision="remote")
        tokens = increase(before, after, computed, service="prefill")
    else:
        prompts = increase(before, after, f"{TTFT}_count", service="gateway")
        tokens = increase(before, after, computed, service="decode")
    return tokens / prompts if prompts > 0 else None


@dataclass(frozen=True)
class Pools:
    """The deployment's pool sizes (as the launcher's control API says them)."""

    prefill: int
    decode: int


@dataclass(frozen=True)
class History:
    """What an observation remembers from the windows before it."""

    points: tuple[tuple[float, float], ...] = ()  # the decode fit's, newest last, at most FIT_POINTS
    capacity_per_worker: float = 0.0  # the last measured (0: never yet)
    mean_prompt_tokens: float = 0.0


def observe(before: Scrape, after: Scrape, window_s: float, at_s: float, pools: Pools,
            history: History = History()) -> tuple[Observation, History]:
    """The observation of the window between the scrapes, and the history the next one starts from."""
    points = (*history.points, *step_points(before, after))[-FIT_POINTS:]
    fixed, per_seq = fit_step_time(points)
    capacity = prefill_capacity(before, after) or history.capacity_per_worker
    prompt = mean_prompt_tokens(before, after, pools.prefill)
    prompt = history.mean_prompt_tokens if prompt is None else prompt
    queued = queued_requests(after)
    grew = max(0.0, queued - queued_requests(before)) * prompt
    arriving = (increase(before, after, "splitserve_prompt_tokens_computed_total", service="prefill") + grew) / window_s
    observation = Observation(
        at_s=at_s,
        prefill=PrefillPool(pools.prefill, arriving, capacity, prompt, round(queued * prompt)),
        decode=DecodePool(pools.decode, round(total(after, "vllm:num_requests_running", service="decode")),
                          fixed, per_seq),
        ttft_p90_ms=_ms(window_quantile(before, after, TTFT, service="gateway")),
        itl_p90_ms=_ms(window_quantile(before, after, ITL, service="gateway")))
    return observation, History(points, capacity, prompt)
