"""The launcher's own calls on the bus under the admin key (`admin`: BusCredentials; None on an open bus): the
operator's messages only that key may send (`RoleSwitch` to a worker, `ServeModel` to the gateway), and reading
which services a namespace's registry holds ready (a further model's, which the gateway's /ready does not judge).
Each call opens its own connection and closes it, within its deadline."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from contracts import RoleSwitch, RoleSwitchReply, ServeModel, ServeModelReply, Subjects
from shared.bus.permissions import ADMIN, inbox_prefix

CONNECT_TIMEOUT_S = 5.0
REGISTRY_READ_TIMEOUT_S = 5.0


@asynccontextmanager
async def admin_connection(nats_url: str, namespace: str, admin, tls_ca: str | None, name: str):
    from shared.bus.connection import connect_once
    from shared.bus.tls import client_tls_context

    nc = await connect_once(nats_url, name, timeout_s=CONNECT_TIMEOUT_S, credentials=admin,
                            inbox_prefix=inbox_prefix(namespace, ADMIN, ADMIN),
                            tls=client_tls_context(tls_ca, None, None, environ={}))
    try:
        yield nc
    finally:
        await nc.close()


def send_switch(nats_url: str, namespace: str, admin, tls_ca: str | None, instance: str, to: str,
                drain_s: float | None, timeout_s: float) -> RoleSwitchReply:
    """The worker's answer to a `RoleSwitch`."""
    async def send() -> RoleSwitchReply:
        async with admin_connection(nats_url, namespace, admin, tls_ca, "splitserve-switch") as nc:
            response = await nc.request(Subjects(namespace).role_switch(instance),
                                        RoleSwitch(to=to, drain_s=drain_s).encode(), timeout=timeout_s)
            return RoleSwitchReply.decode(response.data)

    return asyncio.run(send())


def send_serve_model(nats_url: str, namespace: str, admin, tls_ca: str | None, gateway_id: str,
                     message: ServeModel, timeout_s: float) -> ServeModelReply:
    """The gateway's answer to a `ServeModel` (`namespace`: the deployment's, where the gateway takes them)."""
    async def send() -> ServeModelReply:
        async with admin_connection(nats_url, namespace, admin, tls_ca, "splitserve-models") as nc:
            response = await nc.request(Subjects(namespace).gateway_models(gateway_id), message.encode(),
                                        timeout=timeout_s)
            return ServeModelReply.decode(response.data)

    return asyncio.run(send())


def ready_in_registry(nats_url: str, namespace: str, admin, tls_ca: str | None,
                      timeout_s: float = REGISTRY_READ_TIMEOUT_S) -> dict[str, int]:
    """How many services of each role `namespace`'s registry holds ready now (none before it is provisioned);
    raises on a bus that does not answer in time."""
    from nats.js.errors import BucketNotFoundError

    from services.gateway.readiness import ready_counts
    from shared.bus.registry import Registry

    async def read() -> dict[str, int]:
        async with admin_connection(nats_url, namespace, admin, tls_ca, "splitserve-registry") as nc:
            try:
                registry = await Registry.bind(nc.jetstream(), Subjects(namespace).registry_bucket, wait_s=0)
            except (BucketNotFoundError, RuntimeError):
                return {}
            return ready_counts(await registry.list())

    return asyncio.run(asyncio.wait_for(read(), timeout_s))
