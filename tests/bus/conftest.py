"""Fixtures of the bus tests: connections to the session's real nats-server, and unique names."""

import time

import pytest
import pytest_asyncio

from support.processes import NatsServer


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
def private_nats_server(tmp_path):
    """A server of the test's own, for tests that stop and restart it."""
    server = NatsServer(tmp_path / "nats-store")
    server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture
async def nc(nats_url):
    from shared.bus.connection import connect, drain

    client = await connect(nats_url, name="test")
    yield client
    await drain(client, timeout_s=2.0)


@pytest.fixture
def js(nc):
    return nc.jetstream(timeout=2.0)


_names = iter(range(1_000_000))


@pytest.fixture
def unique():
    """A fresh name per call (`unique("stream")` -> "stream-3"), so tests sharing the server never collide."""
    return lambda prefix: f"{prefix}-{next(_names)}-{int(time.time() * 1000) % 100000}"
