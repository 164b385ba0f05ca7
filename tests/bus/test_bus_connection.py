import asyncio
import logging
import time

import nats.errors
import pytest

from shared.bus.connection import BusConnectionError, connect, connect_once, drain
from support.processes import free_port
from support.waiting import eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def test_dead_url_fails_fast_naming_the_url():
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BusConnectionError, match=url):
        await connect(url, name="test", connect_timeout_s=0.5)
    assert time.monotonic() - started < 2.0


async def test_reconnects_after_the_server_restarts(private_nats_server):
    nc = await connect(private_nats_server.url, name="test", reconnect_wait_s=0.1)
    try:
        async def echo(msg):
            await msg.respond(msg.data)

        await nc.subscribe("echo", cb=echo)
        assert (await nc.request("echo", b"before", timeout=2)).data == b"before"

        private_nats_server.stop()
        await eventually(lambda: not nc.is_connected, what="the client sees the server gone")
        private_nats_server.start()
        await eventually(lambda: nc.is_connected, timeout_s=10, what="reconnected")
        # The subscription is re-established on the new connection.
        assert (await nc.request("echo", b"after", timeout=2)).data == b"after"
    finally:
        await drain(nc, timeout_s=2)
    assert nc.is_closed


async def test_drain_is_bounded_and_idempotent(nats_url):
    nc = await connect(nats_url, name="test")
    stuck, handling = asyncio.Event(), asyncio.Event()

    async def never_finishes(msg):
        handling.set()
        await stuck.wait()

    await nc.subscribe("stuck", cb=never_finishes)
    await nc.publish("stuck", b"x")
    await asyncio.wait_for(handling.wait(), timeout=5)

    started = time.monotonic()
    await drain(nc, timeout_s=0.5)
    assert time.monotonic() - started < 2.5
    assert nc.is_closed
    await drain(nc)  # already closed: nothing to do


async def test_a_one_off_connection_reset_while_connecting_raises_to_its_caller_without_a_logged_traceback(caplog):
    async def reset_at_once(reader, writer):  # as a server reloading its config may do to a connection being made
        writer.transport.abort()

    server = await asyncio.start_server(reset_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with caplog.at_level(logging.DEBUG), pytest.raises((OSError, TimeoutError, nats.errors.Error)):
            await connect_once(f"nats://127.0.0.1:{port}", "test-once", timeout_s=2.0)
    finally:
        server.close()
        await server.wait_closed()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a failure the caller reports is not logged"


async def test_a_one_off_connection_serves_its_call_and_does_not_reconnect(private_nats_server):
    nc = await connect_once(private_nats_server.url, "test-once")
    try:
        assert nc.is_connected and not nc.options["allow_reconnect"]
        await nc.flush(timeout=2)
        private_nats_server.stop()
        await eventually(lambda: nc.is_closed, what="closed with its server, not reconnecting")
    finally:
        await nc.close()
