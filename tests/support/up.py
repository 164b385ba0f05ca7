"""`splitserve up` as the tests run it: a real launcher process, started until it says ready."""

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.launcher.service_spawner import SpawnedService
from support.processes import ROOT, SPAWNER, free_port, service_env

MODEL = "splitserve-default-llama"  # the built-in random model, by name: no download


@dataclass
class UpRun:
    proc: SpawnedService  # (driven as a subprocess.Popen)
    url: str  # the gateway, http://127.0.0.1:PORT
    run_dir: Path
    namespace: str
    output: list[str]

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, as an operator stops it; SIGKILL to the whole group if it does not stop in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def forked_launch(argv: list[str], env: dict[str, str], cwd: Path) -> SpawnedService:
    """`splitserve up`'s command line started as a fork of the tests' preloaded forkserver, as start_service's
    services are: the launcher then holds torch and the rest already, and forks its own forkserver rather than start
    one that imports them all again. Its output is a binary pipe (`stdout`); it leads its own session, and gets
    SIGTERM if the tests die. The suite's `services.bench.up_process.LAUNCH`."""
    read, write = os.pipe()
    proc = SPAWNER.spawn(argv, env=env, cwd=str(cwd), output_fd=write, death_signal=signal.SIGTERM)
    os.close(write)
    assert proc is not None, f"not a command the spawner forks: {argv}"
    proc.stdout = os.fdopen(read, "rb")
    return proc


def start_up(run_dir: Path, *args: str, env: dict | None = None, namespace: str | None = None,
             ready_timeout_s: float = 180, model: str | None = MODEL) -> UpRun:
    """`splitserve up --model MODEL ARGS...` (no --model with `model=None`: up's default) on a free port and its own
    namespace; returns once it is ready."""
    port, namespace = free_port(), namespace or "up" + uuid.uuid4().hex[:8]
    argv = [sys.executable, "-m", "services.cli.main", "up", *(["--model", model] if model else []), "--port",
            str(port), "--run-dir", str(run_dir), "--namespace", namespace, *args]
    proc = forked_launch(argv, env or service_env(), ROOT)
    proc.stdout = io.TextIOWrapper(proc.stdout, errors="replace")
    run = UpRun(proc, f"http://127.0.0.1:{port}", run_dir, namespace, [])
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        run.output.append(line)
        if line.startswith("splitserve ready:"):
            return run
    run.stop(timeout_s=10)
    raise AssertionError("splitserve up did not become ready:\n" + "".join(run.output))


def ps(run_dir: Path) -> dict:
    """What `splitserve ps --run-dir RUN_DIR --json` prints, read here: the command's own snapshot, without an
    interpreter start for every look (tests/launcher run the command itself)."""
    from services.cli.ps import snapshot
    from services.launcher.deployment import read_deployment, resolve_run_dir

    deployment = read_deployment(resolve_run_dir(run_dir))
    assert deployment is not None, f"no deployment in {run_dir}"
    return json.loads(json.dumps(snapshot(deployment)))
