"""A tenant's tokens-per-minute limit as a token bucket: pure functions over an immutable state.

The bucket holds up to `capacity` tokens (a minute's worth) and refills at capacity/60 per second. A request is
let in when the bucket holds its prompt's tokens (a prompt larger than the bucket, when it is full); it takes
them then and its completion's once it is done, which may leave the bucket in debt: later requests wait for it.
"""

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Bucket:
    capacity: float  # tokens per minute
    level: float  # tokens now (negative: in debt)
    at: float  # when `level` was read (monotonic seconds)

    @property
    def rate(self) -> float:
        return self.capacity / 60.0


def full(tokens_per_minute: float, now: float) -> Bucket:
    return Bucket(float(tokens_per_minute), float(tokens_per_minute), now)


def refilled(bucket: Bucket, now: float) -> Bucket:
    level = min(bucket.capacity, bucket.level + max(0.0, now - bucket.at) * bucket.rate)
    return replace(bucket, level=level, at=max(now, bucket.at))


def admit(bucket: Bucket, tokens: int, now: float) -> tuple[Bucket, float | None]:
    """(the bucket after, None) when `tokens` may go now (taken); else (the bucket, seconds until they may)."""
    bucket = refilled(bucket, now)
    need = min(float(tokens), bucket.capacity)
    if bucket.level >= need:
        return replace(bucket, level=bucket.level - tokens), None
    return bucket, (need - bucket.level) / bucket.rate


def charge(bucket: Bucket, tokens: int, now: float) -> Bucket:
    """Take `tokens` already spent (a completion's), into debt if need be."""
    bucket = refilled(bucket, now)
    return replace(bucket, level=bucket.level - tokens)
