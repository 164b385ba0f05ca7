"""JetStream streams and consumers, declared where they are used and provisioned idempotently.

Every service that uses a stream or consumer calls `ensure_*` at start with the
configuration it needs: the first creates it, the rest find it as declared, and
one started with a new configuration updates it. Two processes doing this at
once is harmless (the server accepts an identical create twice). A change the
server cannot make in place (storage type, retention to or from work-queue)
raises `ProvisionError` naming the stream and the fields.
"""

import asyncio
import functools
import time
from dataclasses import dataclass

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from shared.telemetry.logging import get_logger

log = get_logger(__name__)

_NS_PER_S = 1_000_000_000
STREAM_NAME_IN_USE = 10058  # JetStream error code: a stream of that name exists with another config
# JetStream error codes of a cluster still forming or electing (tried again while settling): no peers to place the
# copies on yet (the meta leader has not heard of every node), no leader to handle the request.
SETTLING_CODES = frozenset({10005, 10008, 10009})


class ProvisionError(RuntimeError):
    """A stream or consumer could not be brought to the declared configuration."""


MAX_REPLICAS = 5  # JetStream's bound on a stream's replicas


def replicas_for(requested: int | None, cluster_size: int) -> int:
    """How many copies of each stream and bucket to keep: `requested` (`--nats-replicas`), else 3 on a cluster of
    3 nodes or more (one node may go and the rest keep a quorum), else 1."""
    if requested is None:
        return 3 if cluster_size >= 3 else 1
    _check_replicas(requested)
    if requested > cluster_size:
        raise ProvisionError(f"--nats-replicas {requested} needs a NATS cluster of {requested} nodes or more; "
                             f"this one has {cluster_size}")
    return requested


@dataclass(frozen=True)
class Replicas:
    """The copies of each stream and bucket a service provisions. `chosen`: the operator's (`--nats-replicas`),
    which existing ones are changed to; otherwise a default from the cluster as this client saw it on connecting,
    given only to what it creates: clients that connected while the cluster's routes were forming would see
    different sizes and undo each other's choice."""

    count: int = 1
    chosen: bool = False


def replicas_asked(requested: int | None, nc) -> Replicas:
    """A service's `Replicas`: `requested` as asked (the servers refuse what the cluster cannot hold), else 3 on a
    cluster of 3 nodes or more as `nc` sees it, else 1."""
    if requested is None:
        return Replicas(3 if cluster_size(nc) >= 3 else 1)
    _check_replicas(requested)
    return Replicas(requested, chosen=True)


def _check_replicas(requested: int) -> None:
    if not 1 <= requested <= MAX_REPLICAS:
        raise ProvisionError(f"--nats-replicas must be 1 to {MAX_REPLICAS}, not {requested}")


def cluster_size(nc) -> int:
    """The nodes of the NATS cluster `nc` is connected to, as its server tells clients (1 when not clustered, or
    when the cluster does not advertise its members)."""
    info = getattr(nc, "_server_info", None) or {}
    return max(1, len(set(info.get("connect_urls") or [])))


SETTLE_S = 30.0  # how long provisioning waits for a JetStream that times out or has no leader yet


async def while_settling(provision, *args, **kwargs):
    """`await provision(*args, **kwargs)`, again every half second while JetStream times out, has no leader or
    cannot place copies yet, for up to `SETTLE_S`."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            return await provision(*args, **kwargs)
        except (nats.errors.TimeoutError, ServiceUnavailableError, nats.errors.NoRespondersError, APIError) as exc:
            if isinstance(exc, APIError) and not settling(exc):
                raise
            if time.monotonic() > deadline:
                if isinstance(exc, APIError):  # e.g. copies the cluster cannot place: it has too few nodes
                    raise ProvisionError(f"JetStream still refused after {SETTLE_S:g} s: {exc.description}") from exc
                raise
            log.info("JetStream not answering yet; provisioning again", error=repr(exc))
            await asyncio.sleep(0.5)


async def _ensure_stream(
    js: JetStreamContext,
    *,
    name: str,
    subjects: list[str],
    retention: str = "limits",
    storage: str = "file",
    max_msgs: int,
    max_bytes: int,
    max_age_s: float,
    duplicate_window_s: float = 120.0,
    replicas: Replicas = Replicas(),
) -> StreamInfo:
    """Create stream `name` (kept on `replicas` nodes of a cluster), or update it to this configuration.

    Limits are required so that every stream is bounded; -1 (or `max_age_s=0`) lifts one explicitly.
    """
    if max_age_s > 0:
        duplicate_window_s = min(duplicate_window_s, max_age_s)  # the server refuses a window past max age
    want = StreamConfig(
        name=name,
        subjects=list(subjects),
        retention=RetentionPolicy(retention),
        storage=StorageType(storage),
        max_msgs=max_msgs,
        max_bytes=max_bytes,
        max_age=max_age_s,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas.count,
    )
    try:
        have = await js.stream_info(name)
    except NotFoundError:
        try:
            info = await js.add_stream(want)
            log.info("stream created", stream=name, subjects=subjects, retention=retention, storage=storage)
            return info
        except APIError as exc:
            if settling(exc):
                raise
            if exc.err_code != STREAM_NAME_IN_USE:
                raise ProvisionError(f"cannot create stream {name!r}: {exc.description}") from exc
            have = await js.stream_info(name)  # another process created it meanwhile, differently
    if not replicas.chosen:
        want.num_replicas = have.config.num_replicas  # a default: for what it creates, not to change
    changed = _stream_changes(have.config, want)
    if not changed:
        return have
    try:
        info = await js.update_stream(want)
    except APIError as exc:
        if settling(exc):
            raise
        raise ProvisionError(f"cannot update stream {name!r} ({', '.join(changed)}): {exc.description}") from exc
    log.info("stream updated", stream=name, changed=changed)
    return info


async def _ensure_pull_consumer(
    js: JetStreamContext,
    *,
    stream: str,
    durable: str,
    filter_subject: str,
    ack_wait_s: float,
    max_deliver: int,
    max_ack_pending: int,
) -> ConsumerInfo:
    """Create durable pull consumer `durable` on `stream`, or update it to this configuration."""
    want = ConsumerConfig(
        durable_name=durable,
        filter_subject=filter_subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
    )
    try:
        have = await js.consumer_info(stream, durable)
    except NotFoundError:
        have = None
    changed = ["(new)"] if have is None else _consumer_changes(have.config, want)
    if not changed:
        return have
    try:
        # Creating a durable that exists with another config updates it, so create and update are one call.
        info = await js.add_consumer(stream, want)
    except APIError as exc:
        if settling(exc):
            raise
        raise ProvisionError(f"cannot provision consumer {durable!r} on stream {stream!r}: {exc.description}") from exc
    log.info("consumer created" if have is None else "consumer updated", stream=stream, consumer=durable, changed=changed)
    return info


def _settled(provision):
    """`provision`, tried again while JetStream is not answering (a cluster still settling); same signature."""

    @functools.wraps(provision)
    async def provisioned(*args, **kwargs):
        return await while_settling(provision, *args, **kwargs)

    return provisioned


ensure_stream = _settled(_ensure_stream)
ensure_pull_consumer = _settled(_ensure_pull_consumer)


def settling(exc: APIError) -> bool:
    """Whether JetStream refused for now only: its cluster is forming or electing a leader."""
    return isinstance(exc, ServiceUnavailableError) or exc.err_code in SETTLING_CODES


def _stream_changes(have: StreamConfig, want: StreamConfig) -> list[str]:
    changes = []
    if sorted(have.subjects or []) != sorted(want.subjects):
        changes.append("subjects")
    for field in ("retention", "storage", "max_msgs", "max_bytes", "num_replicas"):
        if getattr(have, field) != getattr(want, field):
            changes.append(field)
    for field in ("max_age", "duplicate_window"):
        if _ns(getattr(have, field)) != _ns(getattr(want, field)):
            changes.append(field)
    return changes


def _consumer_changes(have: ConsumerConfig, want: ConsumerConfig) -> list[str]:
    changes = [f for f in ("filter_subject", "max_deliver", "max_ack_pending") if getattr(have, f) != getattr(want, f)]
    if _ns(have.ack_wait) != _ns(want.ack_wait):
        changes.append("ack_wait")
    return changes


def _ns(seconds: float | None) -> int:
    return round((seconds or 0) * _NS_PER_S)
