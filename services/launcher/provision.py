"""Provision a deployment's streams, consumers and registry bucket with the admin key (`up`, `splitserve provision`).

Services on a secured bus may only bind to these; this is the one identity that
makes or changes them (see `services.common.queues`).
"""

from __future__ import annotations

import asyncio

from contracts import Subjects
from shared.bus.credentials import BusCredentials
from shared.bus.provision import Replicas, replicas_asked

PROVISION_TIMEOUT_S = 60.0


def provision(nats_url: str, namespace: str, credentials: BusCredentials | None, tls_ca: str | None = None,
              replicas: int | None = None) -> None:
    """Make the deployment `namespace` on `nats_url` as declared (idempotent; raises on a refusal)."""
    asyncio.run(asyncio.wait_for(_provision(nats_url, namespace, credentials, tls_ca, replicas),
                                 PROVISION_TIMEOUT_S))


async def _provision(nats_url: str, namespace: str, credentials: BusCredentials | None, tls_ca: str | None,
                     replicas: int | None) -> None:
    from services.common.queues import provision_deployment
    from shared.bus.connection import connect_once
    from shared.bus.tls import client_tls_context

    nc = await connect_once(nats_url, "splitserve-provision", credentials=credentials,
                            tls=client_tls_context(tls_ca, None, None, environ={}))
    try:
        copies: Replicas = replicas_asked(replicas, nc)
        await provision_deployment(nc.jetstream(), Subjects(namespace), copies)
    finally:
        await nc.close()
