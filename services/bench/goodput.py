"""A rate sweep's figures (pure): each rate's row, and the headline, DistServe's "max rate at SLO attainment".

The sweep runs a grid of rates (--sweep-rates), not a bisection: every configuration of `bench compare` is then
measured at the same rates (columns that line up), each point is a full run whose cost is known up front, and a
noisy attainment (a few requests per rate) cannot send a bisection the wrong way for good.

The headline, `max_rate`, is a measured rate: the highest swept rate such that it and every lower swept rate
met the attainment target (a pass above a failure is taken for noise, not capacity). `max_rate_interpolated`
reads the crossing off the straight line between that rate and the next one swept, as DistServe reads it off its
attainment curve.
"""

import math


def parse_rates(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0]: the rates to sweep, ascending and distinct, each positive and finite."""
    try:
        rates = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--sweep-rates takes comma-separated numbers, not {text!r}") from None
    if not rates or not all(0 < rate < math.inf for rate in rates):
        raise ValueError(f"--sweep-rates needs positive finite rates, not {text!r}")
    return rates


def _passing_prefix(points: list[tuple[float, float | None]], target: float) -> int:
    """How many of `points` (rate, attainment), in rate order, meet `target` before the first that does not."""
    ordered = sorted(points)
    for index, (_, attained) in enumerate(ordered):
        if attained is None or attained < target:
            return index
    return len(ordered)


def max_rate_at_attainment(points: list[tuple[float, float | None]], target: float) -> float | None:
    """The highest rate that met `target` with every lower rate swept; None when the lowest did not."""
    passed = _passing_prefix(points, target)
    return sorted(points)[passed - 1][0] if passed else None


def interpolated_max_rate(points: list[tuple[float, float | None]], target: float) -> float | None:
    """Where attainment crosses `target` on the straight line between max_rate_at_attainment and the next rate
    swept; that rate itself when it is the last; None when the lowest rate did not meet it."""
    ordered, passed = sorted(points), _passing_prefix(points, target)
    if not passed:
        return None
    (low, at_low) = ordered[passed - 1]
    if passed == len(ordered) or ordered[passed][1] is None:
        return low
    high, at_high = ordered[passed]
    return low + (high - low) * (at_low - target) / (at_low - at_high)  # at_low >= target > at_high


def sweep_row(rate: float, result: dict) -> dict:
    """One rate's line of the sweep from its run's figures (services/bench/metrics.py)."""
    return {"rate": rate, "slo_attainment": result["slo_attainment"], "goodput": result["goodput"],
            "request_throughput": result["request_throughput"], "output_throughput": result["output_throughput"],
            "completed": result["completed"], "failed": result["failed"],
            **{f"{key.removesuffix('_ms')}_{stat}_ms": result[key][stat]
               for key in ("ttft_ms", "tpot_ms") for stat in ("p50", "p90")}}


def headline(rows: list[dict], target: float) -> dict:
    """The sweep's summary: the target and both readings of the max rate at it."""
    points = [(row["rate"], row["slo_attainment"]) for row in rows]
    return {"attainment_target": target, "max_rate": max_rate_at_attainment(points, target),
            "max_rate_interpolated": interpolated_max_rate(points, target)}
