"""SamplingParams to and from the wire's `Sampling` part (the same fields, one checked where it is made)."""

import dataclasses

import msgspec

from contracts import Sampling
from shared.engine import SamplingParams


def to_wire(params: SamplingParams) -> Sampling:
    return Sampling(**dataclasses.asdict(params))


def from_wire(sampling: Sampling) -> SamplingParams:
    """Raises InvalidRequestError naming the field when a value is out of range (the wire checks only types)."""
    return SamplingParams(**msgspec.structs.asdict(sampling))
