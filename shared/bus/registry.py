"""The service registry: a JetStream KV bucket of `ServiceInfo`, one key per instance.

Keys are `{role}.{instance_id}`: NATS permissions then let each role write only
its own entries (`$KV.{bucket}.{role}.>`), so a credential of one role cannot
pose as a worker of another, and an entry whose key does not match its
contents is not trusted.

Liveness is the bucket's max age (`ttl_s`): every put is a new message, the
server deletes messages older than the max age, so an entry whose service stops
heartbeating disappears about `ttl_s` after its last put. A `Heartbeat` puts
the entry every `interval_s`, well inside the TTL, so one lost put is harmless.
Readers never trust an entry blindly: one that does not decode as a
`ServiceInfo` is skipped, counted in `Registry.num_malformed`, and said once a
minute per key (a key names its writer).

The bucket is provisioned (`Registry.open`) by whoever holds the right: the
deployment's provisioner on a secured bus, any service on an open one. It
refuses what no service needs and an attacker would use: rollup headers (a
rollup wipes every other entry), purges, deleting messages, and values over
`MAX_ENTRY_BYTES`. Services on a secured bus only bind to it (`Registry.bind`).
"""

import asyncio
import time
from dataclasses import replace
from collections.abc import Awaitable, Callable

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    NoStreamResponseError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from contracts import ContractError, ServiceInfo, check_token
from shared.bus.provision import STREAM_NAME_IN_USE, Replicas, settling, while_settling
from shared.bus.waits import cancel_and_wait, within
from shared.telemetry.log_limiter import LogLimiter
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

DEFAULT_TTL_S = 6.0
MAX_ENTRY_BYTES = 16 * 1024  # a ServiceInfo is well under 1 KiB
BIND_WAIT_S = 120.0  # how long a service waits for the deployment's provisioner to make the bucket


class Registry:
    def __init__(self, js: JetStreamContext, kv: KeyValue, bucket: str, ttl_s: float):
        self.js = js
        self.kv = kv
        self.bucket = bucket
        self.stream = f"KV_{bucket}"  # the stream behind a KV bucket, by JetStream's convention
        self.ttl_s = ttl_s
        self.num_malformed = 0  # entries skipped because they did not decode, counted on every read
        self._malformed_log = LogLimiter()

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, ttl_s: float = DEFAULT_TTL_S,
                   replicas: Replicas = Replicas()) -> "Registry":
        """Provision: create the bucket (kept on `replicas.count` nodes of a cluster), or bind to it (setting its
        TTL, its hardening, and its replicas if chosen, where they differ); tried again while JetStream is
        settling."""
        return await while_settling(cls._open, js, bucket, ttl_s, replicas)

    @classmethod
    async def bind(cls, js: JetStreamContext, bucket: str, wait_s: float = BIND_WAIT_S) -> "Registry":
        """Bind to the bucket the provisioner made (its TTL as configured), waiting up to `wait_s` for it."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                kv = await while_settling(js.key_value, bucket)
                break
            except BucketNotFoundError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the registry bucket {bucket!r} does not exist: the deployment is not "
                                       "provisioned (`splitserve provision` with the admin key)") from None
                log.info("waiting for the deployment to be provisioned", bucket=bucket)
                await asyncio.sleep(1.0)
        config = (await kv.status()).stream_info.config
        return cls(js, kv, bucket, config.max_age or DEFAULT_TTL_S)

    @classmethod
    async def _open(cls, js: JetStreamContext, bucket: str, ttl_s: float, replicas: Replicas) -> "Registry":
        if ttl_s <= 0:
            raise ValueError(f"registry ttl_s must be positive, got {ttl_s}")
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            try:
                # Two services creating it at once with the same TTL both succeed.
                kv = await js.create_key_value(KeyValueConfig(bucket=bucket, ttl=ttl_s, history=1,
                                                              storage=StorageType.FILE, replicas=replicas.count,
                                                              max_value_size=MAX_ENTRY_BYTES))
                log.info("registry bucket created", bucket=bucket, ttl_s=ttl_s, replicas=replicas.count)
            except APIError as exc:
                if settling(exc) or exc.err_code != STREAM_NAME_IN_USE:
                    raise
                kv = await js.key_value(bucket)  # created meanwhile with another TTL
        await _configure(js, bucket, kv, ttl_s, replicas)
        return cls(js, kv, bucket, ttl_s)

    def unavailable(self, exc: BaseException) -> bool:
        """Whether `exc` (from a put or read) says the registry itself is unavailable to everyone now: its stream
        answered nobody (no leader, while the cluster elects one) with this client connected."""
        return self.js._nc.is_connected and isinstance(exc, (NoStreamResponseError, ServiceUnavailableError))

    async def put(self, info: ServiceInfo) -> None:
        await self.kv.put(entry_key(info.role, info.instance_id), info.encode())

    async def remove(self, role: str, instance_id: str) -> None:
        await self.kv.delete(entry_key(role, instance_id))

    async def get(self, role: str, instance_id: str) -> ServiceInfo | None:
        key = entry_key(role, instance_id)
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        return self._decode(key, entry.value)

    async def list(self) -> list[ServiceInfo]:
        """Every live entry, in key order."""
        # The stream's subjects are the keys that hold a message: live entries and delete markers.
        info = await self.js.stream_info(self.stream, subjects_filter=f"$KV.{self.bucket}.>")
        prefix_len = len(f"$KV.{self.bucket}.")
        keys = sorted(subject[prefix_len:] for subject in (info.state.subjects or {}))
        found = await asyncio.gather(*(self._get_raw(key) for key in keys))
        entries = (self._decode(key, value) for key, value in zip(keys, found) if value is not None)
        return [entry for entry in entries if entry is not None]

    async def _get_raw(self, key: str) -> bytes | None:
        try:
            entry = await self.kv.get(key, validate_keys=False)
        except KeyNotFoundError:  # deleted, or expired since the listing
            return None
        return entry.value or b""

    def _decode(self, key: str, value: bytes | None) -> ServiceInfo | None:
        try:
            info = ServiceInfo.decode(value or b"")
            if key != f"{info.role}.{info.instance_id}":
                raise ContractError(f"entry under key {key!r} is {info.role} {info.instance_id!r}", "wrong_key")
        except ContractError as exc:
            self.num_malformed += 1
            quiet = self._malformed_log.allow(key)
            if quiet is not None:
                log.warning("malformed registry entry skipped", bucket=self.bucket, key=key, reason=exc.reason,
                            error=str(exc), skipped_quietly_since=quiet)
            return None
        return info


class Readings:
    """Whether an entry missing from a registry read says its service is gone: only once the registry has been
    readable for a TTL. While its stream had no leader (a NATS node lost, a new leader being elected) nobody's
    heartbeat got in, and the entries that expired meanwhile are back with the next beats."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._readable_since: float | None = float("-inf")  # none failed yet

    def failed(self) -> None:
        self._readable_since = None

    def absences_count(self, read_at: float) -> bool:
        """Record a good read at `read_at` (time.monotonic); whether what it lacks is news."""
        if self._readable_since is None:
            self._readable_since = read_at
        return read_at - self._readable_since > self.ttl_s


def entry_key(role: str, instance_id: str) -> str:
    return f"{check_token(role, 'role')}.{check_token(instance_id, 'instance id')}"


class Heartbeat:
    """Keeps one service's entry alive: puts `make_info()` now and every `interval_s`."""

    def __init__(self, registry: Registry, make_info: Callable[[], ServiceInfo], interval_s: float = 1.0,
                 on_lapse: Callable[[float], Awaitable[None]] | None = None):
        """`on_lapse(seconds)`, before a put: the last good one was more than the TTL ago (the process stalled, or
        lost NATS), so the entry expired meanwhile and its peers took it for gone. Not called when every put in
        between failed for the registry itself (its stream had no leader, with this client connected): nobody's
        heartbeat or read got through then, so no peer took the entry's absence for news (`Gateway` waits a TTL
        after the registry is readable again before it does)."""
        if not 0 < interval_s < registry.ttl_s:
            raise ValueError(f"heartbeat interval {interval_s}s must be positive and below the registry TTL {registry.ttl_s}s")
        self.registry = registry
        self.make_info = make_info
        self.interval_s = interval_s
        self.on_lapse = on_lapse
        self.num_failed = 0
        self.num_lapses = 0
        self.num_outages = 0  # lapses that were the registry's, not this service's
        # Since the last good put: whether every put failed for the registry itself (None: none failed), and the
        # widest spacing of the tries (a process that froze made none meanwhile).
        self._registry_failed: bool | None = None
        self._last_try: float | None = None
        self._widest_try_gap = 0.0
        self._last_put: float | None = None  # time.monotonic() of the last good put
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._entry: tuple[str, str] | None = None  # (role, instance id) last put

    @property
    def _put_bound_s(self) -> float:
        return min(self.registry.ttl_s, 2 * self.interval_s)

    @property
    def _max_try_gap_s(self) -> float:
        """The widest spacing of tries a live heartbeat shows (a beat, or a put that ran to its bound), short of the
        TTL: past it, the process was frozen."""
        return min(0.9 * self.registry.ttl_s, max(self.registry.ttl_s / 2, self.interval_s + self._put_bound_s))

    def fresh(self) -> bool:
        """Whether the entry is being kept: a put went through within the registry's TTL."""
        return self._last_put is not None and time.monotonic() - self._last_put <= self.registry.ttl_s

    def start(self) -> asyncio.Task:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="registry-heartbeat")
        return self._task

    async def stop(self, remove: bool = True) -> None:
        """Stop beating; with `remove`, delete the entry now rather than letting it expire."""
        if self._task is not None:
            self._stopping = True  # ends the loop even if a cancellation gets swallowed
            await cancel_and_wait(self._task, timeout_s=self.registry.ttl_s)
            self._task = None
        if remove and self._entry is not None:
            try:
                await within(self.registry.ttl_s, self.registry.remove(*self._entry))
            except Exception as exc:  # the entry expires by itself anyway
                log.warning("registry entry not removed", instance_id=self._entry[1], error=str(exc) or type(exc).__name__)

    async def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._stopping:
            await self._beat()
            next_beat += self.interval_s
            await asyncio.sleep(max(0.0, next_beat - time.monotonic()))

    async def _beat(self) -> None:
        try:
            now = time.monotonic()
            if self._last_try is not None:
                self._widest_try_gap = max(self._widest_try_gap, now - self._last_try)
            self._last_try = now
            gap_s = now - self._last_put if self._last_put is not None else 0.0
            if gap_s > self.registry.ttl_s:
                self._last_put = None  # one call per lapse
                if self._registry_failed and self._widest_try_gap <= self._max_try_gap_s:
                    self.num_outages += 1
                    log.warning("the registry was unavailable longer than its TTL; putting the entry again",
                                seconds_since_last_heartbeat=round(gap_s, 1))
                else:
                    self.num_lapses += 1
                    if self.on_lapse is not None:
                        await self.on_lapse(gap_s)
            info = self.make_info()
            info.heartbeat_ms = int(time.time() * 1000)
            self._entry = (info.role, info.instance_id)
            # Bounded well inside the TTL: a put stuck on a connection failing over gives way to the next beat,
            # which goes out on the new one.
            await within(self._put_bound_s, self.registry.put(info))
            self._last_put = time.monotonic()
            self._registry_failed, self._widest_try_gap = None, 0.0
        except Exception as exc:  # NATS away, a bad info: try again next tick, never end the task
            self._registry_failed = self._registry_failed is not False and self.registry.unavailable(exc)
            self.num_failed += 1
            log.warning("heartbeat failed", error=str(exc) or type(exc).__name__, num_failed=self.num_failed)


def _hardened(config):
    """The bucket's stream as the registry needs it: no rollups, purges or deletes; bounded values."""
    return replace(config, allow_rollup_hdrs=False, deny_purge=True, deny_delete=True, max_msg_size=MAX_ENTRY_BYTES)


async def _configure(js: JetStreamContext, bucket: str, kv: KeyValue, ttl_s: float, replicas: Replicas) -> None:
    have = (await kv.status()).stream_info.config
    count = replicas.count if replicas.chosen else (have.num_replicas or 1)  # a default does not change it
    config = _hardened(have)
    if (round((have.max_age or 0) * 1e9) == round(ttl_s * 1e9) and (have.num_replicas or 1) == count
            and config == have):
        return
    config.max_age = ttl_s
    config.duplicate_window = min(config.duplicate_window or ttl_s, ttl_s)
    config.num_replicas = count
    try:
        await js.update_stream(config)
    except APIError as exc:
        if settling(exc):
            raise
        raise RuntimeError(f"cannot set registry bucket {bucket!r} to a TTL of {ttl_s}s and {count} replicas: "
                           f"{exc.description}") from exc
    log.info("registry bucket updated", bucket=bucket, ttl_s=ttl_s, replicas=count)
