"""The shifting trace: a workload whose mix and rate change over time, as data and pure functions (no I/O).

Phases follow each other, each `--phase-seconds` long. A phase's arrivals are a Poisson process whose rate goes
linearly from `rate_from` to `rate_to` over the phase (constant where they are equal), times `--trace-rate-scale`;
its requests have the lengths of its `shape` (the options named in SHAPES). SHIFTING is the trace of issue 37: a
prefill-heavy phase (long prompts, short outputs), a decode-heavy one (short prompts, long outputs), then a ramp
0.5 -> 3 -> 0.5 req/s of ordinary requests.
"""

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    shape: str  # a key of SHAPES: which options give its requests' prompt and output lengths
    rate_from: float  # req/s at the phase's start (before --trace-rate-scale)
    rate_to: float  # ... and at its end


SHAPES = {
    "prefill-heavy": ("long_input_len", "long_output_len"),
    "decode-heavy": ("decode_heavy_input_len", "decode_heavy_output_len"),
    "base": ("input_len", "output_len"),
}

SHIFTING = (
    Phase("prefill-heavy", "prefill-heavy", 1.0, 1.0),
    Phase("decode-heavy", "decode-heavy", 1.0, 1.0),
    Phase("ramp-up", "base", 0.5, 3.0),
    Phase("ramp-down", "base", 3.0, 0.5),
)


def expected_arrivals(rate_from: float, rate_to: float, seconds: float) -> float:
    """The mean number of arrivals of a phase: the integral of its (linear) rate."""
    return seconds * (rate_from + rate_to) / 2


def time_at_intensity(rate_from: float, rate_to: float, seconds: float, mass: float) -> float:
    """The time t in [0, seconds] by which the rate, going linearly from `rate_from` to `rate_to`, has
    integrated to `mass` (the inverse of the cumulative intensity a*t + (b - a)*t^2 / (2*seconds))."""
    if mass <= 0:
        return 0.0
    slope = (rate_to - rate_from) / seconds
    # The root of slope/2 t^2 + a t - mass = 0 written as 2 mass / (a + sqrt(a^2 + 2 slope mass)): no
    # cancellation when the slope is tiny, and exact (mass / a) when it is zero.
    return 2 * mass / (rate_from + math.sqrt(max(0.0, rate_from * rate_from + 2 * slope * mass)))


def phase_arrivals(rate_from: float, rate_to: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival offsets (s from the phase's start, ascending) of a Poisson process whose rate goes linearly from
    `rate_from` to `rate_to` over `seconds`: unit-rate arrivals in cumulative intensity, mapped back to time."""
    if rate_from < 0 or rate_to < 0 or seconds <= 0:
        raise ValueError("a phase needs rates >= 0 and a positive length")
    total, times = expected_arrivals(rate_from, rate_to, seconds), []
    mass = rng.expovariate(1.0)
    while mass < total:
        times.append(min(seconds, time_at_intensity(rate_from, rate_to, seconds, mass)))
        mass += rng.expovariate(1.0)
    return times


def trace_arrivals(phases: tuple[Phase, ...], phase_seconds: float, rate_scale: float,
                   seed: int) -> list[tuple[float, int]]:
    """Every arrival of the trace as (seconds from its start, the phase's index), in time order."""
    rng = random.Random(seed)
    arrivals = []
    for index, phase in enumerate(phases):
        start = index * phase_seconds
        arrivals += [(start + t, index) for t in phase_arrivals(phase.rate_from * rate_scale,
                                                                  phase.rate_to * rate_scale, phase_seconds, rng)]
    return arrivals
