"""A deployment's JetStream streams as the operator sees them (admin credentials), for cluster tests."""

import asyncio

import nats
import nats.errors

from shared.bus.credentials import credentials_from


async def _streams(nats_url: str, admin_creds: str | None) -> dict[str, tuple[int, int]]:
    options = credentials_from(admin_creds, environ={}).connect_options() if admin_creds else {}
    nc = await nats.connect(servers=nats_url.split(","), **options)
    try:
        return {info.config.name: (info.config.num_replicas,
                                   1 + sum(1 for peer in info.cluster.replicas or [] if peer.current))
                for info in await nc.jetstream().streams_info()}
    finally:
        await nc.close()


def stream_replicas(nats_url: str, admin_creds: str | None = None) -> dict[str, tuple[int, int]]:
    """Each stream: (replicas, replicas current: the leader and the followers caught up)."""
    return asyncio.run(_streams(nats_url, admin_creds))


def all_current(nats_url: str, admin_creds: str | None = None) -> bool:
    """Whether every stream has all its replicas current (False while the JetStream API does not answer)."""
    try:
        return all(r == current for r, current in stream_replicas(nats_url, admin_creds).values())
    except (nats.errors.Error, TimeoutError, OSError):
        return False
