"""The run directory of a `splitserve up` deployment.

    RUN_DIR/                    default ./.splitserve/run (or $SPLITSERVE_RUN_DIR, or --run-dir)
      deployment.json           what runs: NATS, each service's pid, state, restarts
      up.lock                   held (flock) by the live launcher
      logs/NAME.log             one log per service, logs/nats.log for the embedded server
      nats/                     the embedded server's JetStream data

`deployment.json` is rewritten atomically (temp file, then rename) whenever
something changes, so a reader (`splitserve ps`) never sees half a file. The
lock is an `flock` on `up.lock`, which the kernel drops when the launcher
exits however it exits, so a crashed launcher never leaves a stale lock; the
launcher pid in `deployment.json` (with its start time, against pid reuse) is
checked as well.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from services.launcher.procs import pid_alive, process_start_time
from shared.private_files import write_private

FORMAT_VERSION = 1
DEPLOYMENT_FILE = "deployment.json"
LOCK_FILE = "up.lock"
RUN_DIR_ENV = "SPLITSERVE_RUN_DIR"
DEFAULT_RUN_DIR = Path(".splitserve") / "run"

# Deployment states, in order of a normal life.
STARTING, READY, STOPPING, STOPPED, FAILED = "starting", "ready", "stopping", "stopped", "failed"
DEGRADED = "degraded"  # ready, with a service marked failed (the rest serve)


class DeploymentError(RuntimeError):
    """deployment.json is unreadable."""


class RunDirBusy(RuntimeError):
    """Another live launcher owns the run directory."""


def default_run_dir() -> Path:
    """`$SPLITSERVE_RUN_DIR`, else `./.splitserve/run` (absolute)."""
    return Path(os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR).expanduser().absolute()


def resolve_run_dir(run_dir: str | os.PathLike | None) -> Path:
    return Path(run_dir).expanduser().absolute() if run_dir else default_run_dir()


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _pick(cls, data: dict[str, Any]) -> dict[str, Any]:
    """The keys of `data` that `cls` knows (newer files may carry more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class ServiceRecord:
    name: str
    role: str
    instance_id: str
    pid: int | None = None
    start_time: int | None = None  # /proc clock ticks, tells pid reuse apart
    argv: list[str] = field(default_factory=list)
    restarts: int = 0
    state: str = "pending"  # the supervisor's: pending/running/restarting/failed/stopping/stopped
    exit_code: int | None = None
    log: str | None = None
    url: str | None = None
    cpus: str | None = None  # a pinned worker's CPUs, as it last acked them (a scale may move it)
    model: str | None = None  # the served name of the model it serves (none: the gateway's and others' for all)

    def alive(self) -> bool:
        return pid_alive(self.pid, self.start_time)


# A model's states: its services start until its scheduler and workers are registered, then the gateway takes it.
MODEL_STARTING, MODEL_SERVING, MODEL_STOPPING, MODEL_FAILED = "starting", "serving", "stopping", "failed"


@dataclass
class ModelRecord:
    """One model the deployment serves (the first one: in the deployment's namespace, its names unprefixed)."""

    name: str  # its served name
    namespace: str  # where its scheduler, workers and kv-store live
    model: str  # its directory
    prefix: str = ""  # its instances' names begin with it
    state: str = MODEL_SERVING
    desired: dict[str, int] = field(default_factory=dict)  # its scalable pools' sizes
    error: str | None = None  # why it failed


@dataclass
class NatsNode:
    """One more node of an embedded cluster (`up --nats-cluster N`)."""
    name: str
    url: str
    pid: int | None = None
    start_time: int | None = None
    restarts: int = 0
    log: str | None = None

    def alive(self) -> bool:
        return pid_alive(self.pid, self.start_time)


@dataclass
class NatsRecord:
    url: str  # every server's, comma-separated on a cluster
    embedded: bool
    pid: int | None = None  # the embedded server's (the first node's on a cluster)
    start_time: int | None = None
    restarts: int = 0
    log: str | None = None
    creds_dir: str | None = None  # each instance's NATS credentials (ID.nk; admin.nk, if anywhere, with `nats-auth`'s)
    nodes: list[NatsNode] = field(default_factory=list)  # an embedded cluster's other nodes

    def alive(self) -> bool:
        return self.embedded and pid_alive(self.pid, self.start_time)

    def processes(self) -> list[tuple[str, int | None, bool]]:
        """(name, pid, alive) of every embedded server."""
        if not self.embedded:
            return []
        first = "nats" if not self.nodes else "nats-0"
        return [(first, self.pid, self.alive()), *((n.name, n.pid, n.alive()) for n in self.nodes)]


@dataclass
class Deployment:
    run_dir: str
    namespace: str
    topology: str
    model: str | None = None
    served_model_name: str | None = None
    gateway_url: str | None = None
    api_url: str | None = None
    nats: NatsRecord | None = None
    services: list[ServiceRecord] = field(default_factory=list)
    state: str = STARTING
    launcher_pid: int | None = None
    launcher_start_time: int | None = None
    started_at: str | None = None
    updated_at: str | None = None
    message: str | None = None  # why it failed, for `ps`
    desired: dict[str, int] = field(default_factory=dict)  # the scalable pools' sizes asked for (`splitserve scale`)
    control_socket: str | None = None  # the launcher's control API, while it runs
    models: list[ModelRecord] = field(default_factory=list)  # every model served, the first first
    version: int = FORMAT_VERSION

    def launcher_alive(self) -> bool:
        return pid_alive(self.launcher_pid, self.launcher_start_time)

    def service(self, name: str) -> ServiceRecord | None:
        return next((s for s in self.services if s.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Deployment:
        data = dict(data)
        nats = data.pop("nats", None)
        services = data.pop("services", None) or []
        models = data.pop("models", None) or []
        dep = cls(**_pick(cls, data))
        dep.models = [ModelRecord(**_pick(ModelRecord, m)) for m in models]
        if nats:
            nodes = [NatsNode(**_pick(NatsNode, n)) for n in nats.pop("nodes", None) or []]
            dep.nats = NatsRecord(**_pick(NatsRecord, nats), nodes=nodes)
        dep.services = [ServiceRecord(**_pick(ServiceRecord, s)) for s in services]
        return dep


def deployment_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / DEPLOYMENT_FILE


def write_deployment(run_dir: str | os.PathLike, deployment: Deployment) -> Path:
    """Write deployment.json atomically; stamps `updated_at`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    deployment.updated_at = now_iso()
    path = deployment_path(run_dir)
    # It names every endpoint of the deployment: its user's alone.
    write_private(path, (json.dumps(deployment.to_dict(), indent=2) + "\n").encode())
    return path


def read_deployment(run_dir: str | os.PathLike) -> Deployment | None:
    """The deployment recorded in `run_dir`, or None if there is none."""
    path = deployment_path(run_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DeploymentError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise DeploymentError(f"cannot read {path}: not a JSON object")
    try:
        return Deployment.from_dict(data)
    except TypeError as exc:
        raise DeploymentError(f"cannot read {path}: {exc}") from exc


def leftover_processes(deployment: Deployment) -> list[tuple[str, int]]:
    """(name, pid) of processes of a dead launcher's deployment still running."""
    left = [(s.name, s.pid) for s in deployment.services if s.alive()]
    if deployment.nats is not None:
        left += [(name, pid) for name, pid, alive in deployment.nats.processes() if alive]
    return left


def _busy_message(run_dir: Path, deployment: Deployment | None) -> str:
    where = f"a splitserve deployment is already running in {run_dir}"
    if deployment is not None and deployment.launcher_pid:
        details = f"launcher pid {deployment.launcher_pid}"
        if deployment.api_url:
            details += f", {deployment.api_url}"
        where += f" ({details})"
        stop = f"stop it first (Ctrl-C in its terminal, or `kill {deployment.launcher_pid}`)"
    else:
        stop = "stop it first"
    return f"{where}; {stop}, or use another --run-dir"


class RunDirLock:
    """Exclusive ownership of a run directory by one live launcher.

        with RunDirLock(run_dir):      # raises RunDirBusy if another up owns it
            ...
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fh = None

    @property
    def held(self) -> bool:
        return self._fh is not None

    def acquire(self) -> RunDirLock:
        if self._fh is not None:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")  # not inherited by children (close-on-exec)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise RunDirBusy(_busy_message(self.run_dir, self._recorded())) from None
        # The lock is ours; a launcher that is alive but lost its lock file
        # (deleted by hand) still owns the directory.
        recorded = self._recorded()
        if recorded is not None and recorded.launcher_pid != os.getpid() and recorded.launcher_alive():
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()
            raise RunDirBusy(_busy_message(self.run_dir, recorded))
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()} {process_start_time(os.getpid()) or ''}\n")
        fh.flush()
        self._fh = fh
        return self

    def _recorded(self) -> Deployment | None:
        try:
            return read_deployment(self.run_dir)
        except DeploymentError:
            return None

    def release(self) -> None:
        if self._fh is None:
            return
        try:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
        finally:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
