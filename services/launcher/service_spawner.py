"""Services started as forks of one process that has already imported torch and transformers.

`python -m services.decode ...` spends several CPU seconds importing torch and transformers before it does anything
of its own: most of a worker's start, paid again by every worker started, restarted after a crash, or added by a
scale. The spawner keeps one multiprocessing forkserver with those modules preloaded (gunicorn's `--preload`, in
effect) and starts each such command line as a fork of it, which runs the module as `python -m` would: its own
session and process group, its output to the given descriptor, exactly the environment given, the working
directory, and `ps` showing the command line it stands for.

Only the same interpreter's `-m services.*` commands fork; anything else returns None, for the caller to start
the usual way. A command whose environment differs from the forkserver's in a variable read while those modules
import (threads, allocators, the hub's settings) is forked but then executes itself: the same process, as it would
have started on its own.

The launcher's promise that a service dies with it holds: the fork asks for a signal when its parent (the
forkserver) dies, and the forkserver exits when the process that started it does.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver, reduction, resource_tracker

from services.launcher.forkserver_fork import fork_forkserver
from services.launcher.procs import set_parent_death_signal

# What the services import that takes time, loaded once in the forkserver: this module first (it notes the
# forkserver's environment before the others can change it), then third-party ones only: the project's own are
# cheap, and stay out of a process that outlives code changes between forks.
PRELOAD = (
    __name__,
    "torch",
    "transformers",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.mistral.modeling_mistral",
    "safetensors.torch",
    "tokenizers",
    "jinja2",
    "numpy",
    "msgspec",
    "nats",
    "uvloop",
    "structlog",
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)

# Variables the preloaded modules (or the native libraries under them) read as they load: a command asking for
# other values than the forkserver started with executes itself, since a fork would keep the forkserver's.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_", "TORCH", "CUDA_",
                        "NVIDIA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "UVLOOP")
# ... except these: a fork applies the first two itself, and torch sets the last as it imports (read later).
APPLIED_AT_FORK = frozenset({"PYTHONUNBUFFERED", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR"})

# The environment this module was imported with: in the forkserver, the one it started with (torch's import adds
# variables of its own).
_IMPORTED_WITH = dict(os.environ)

SESSION_WAIT_S = 5.0  # for a fork to lead its own process group (it does so first thing)


def service_module(argv: Sequence[str], executable: str = sys.executable,
                   packages: tuple[str, ...] = ("services.",)) -> tuple[str, list[str]] | None:
    """(module, its arguments) for `EXECUTABLE -m services.X ARGS` (a module of one of `packages`), else None (not
    a command a fork can run)."""
    if len(argv) < 3 or argv[1] != "-m" or not argv[2].startswith(packages):
        return None
    if not same_interpreter(argv[0], executable):
        return None
    return argv[2], list(argv[3:])


def same_interpreter(python: str, executable: str = sys.executable) -> bool:
    """Whether commands run by `python` can be forks of this interpreter (the only ones a spawner forks)."""
    return os.path.realpath(python) == os.path.realpath(executable)


def import_time_changes(server_env: Mapping[str, str], child_env: Mapping[str, str]) -> list[str]:
    """The variables read while the preloaded modules import whose value differs between the forkserver's
    environment and the one a command asks for."""
    names = {*server_env, *child_env}
    return sorted(name for name in names
                  if name.startswith(IMPORT_TIME_PREFIXES) and name not in APPLIED_AT_FORK
                  and server_env.get(name) != child_env.get(name))


class _InheritedFd:
    """A descriptor handed to the fork (multiprocessing passes it over the forkserver's socket)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _inherited_fd, (reduction.DupFd(self.fd),)


def _inherited_fd(duplicate) -> int:
    return duplicate.detach()


@dataclass(frozen=True, slots=True)
class _Launch:
    """What a fork needs to run one command line."""

    argv: tuple[str, ...]
    module: str
    args: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    output: _InheritedFd | int  # sent as the former, received as the descriptor's number in the fork
    death_signal: int | None


class SpawnedService:
    """A forked service, driven as a `subprocess.Popen`: pid, args, poll, wait, signals, returncode, stdout."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str], stdout=None):
        self._process = process
        self.pid = process.pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self.returncode = self._process.exitcode  # (its descriptors close with it, when it is collected)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ServiceSpawner:
    """Forks `python -m services.*` command lines off one preloaded forkserver (started with the first)."""

    def __init__(self, preload: Sequence[str] = PRELOAD, *, enabled: bool = True,
                 packages: tuple[str, ...] = ("services.",), fork_if_preloaded: bool = False):
        self.packages = packages
        self.enabled = enabled  # (off: spawn() always None, every command started the usual way)
        self.preload = tuple(preload)
        self.fork_if_preloaded = fork_if_preloaded  # (for a small process: a fat one's forks would carry it all)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))  # (for the process's one forkserver, when it starts)

    def start(self) -> None:
        """Start the forkserver now: it imports while the caller goes on (the first spawn would start it). A
        process that has imported the preload already (itself a fork of a preloaded one) may fork it instead."""
        if self.enabled and not (self.fork_if_preloaded and fork_forkserver(self.preload)):
            forkserver.ensure_running()

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
              output_fd: int, death_signal: int | None = None) -> SpawnedService | None:
        """`argv` started as a fork writing its stdout and stderr to `output_fd` (the caller keeps and closes its
        own copy), with exactly `env` (None: this process's), in `cwd` (None: this one's), getting `death_signal`
        when the launcher dies. None where the command is not one to fork (see the module's doc)."""
        target = service_module(argv, packages=self.packages) if self.enabled else None
        if target is None:
            return None
        module, args = target
        launch = _Launch(tuple(argv), module, tuple(args), dict(os.environ if env is None else env),
                         cwd or os.getcwd(), _InheritedFd(output_fd), death_signal)
        process = self._context.Process(target=_run, args=(launch,), name=module, daemon=True)
        process.start()
        service = SpawnedService(process, list(argv))
        _wait_for_own_session(service)
        return service


def _wait_for_own_session(service: SpawnedService) -> None:
    """Until the fork leads its process group (so a signal to the group reaches it), or it ended."""
    deadline = time.monotonic() + SESSION_WAIT_S
    while time.monotonic() < deadline and service.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(service.pid) == service.pid:
                return
        time.sleep(0.001)


def _run(launch: _Launch) -> None:
    """In the fork: become the command line, and run its module as `python -m` does."""
    os.setsid()
    multiprocessing.current_process().daemon = False  # (a launcher among them starts a forkserver of its own)
    _show_command_line(launch.argv)  # (before the environment changes: it takes the room of the initial one)
    _let_the_forkserver_go()
    if launch.death_signal:
        server = os.getppid()
        set_parent_death_signal(launch.death_signal)
        if os.getppid() != server:  # the forkserver (with the launcher) died before the signal was asked for
            os._exit(1)
    output = launch.output
    os.dup2(output, 1)
    os.dup2(output, 2)
    if output > 2:
        os.close(output)
    os.chdir(launch.cwd)
    if import_time_changes(_IMPORTED_WITH, launch.env):  # the preloaded modules do not fit: start afresh, in place
        os.execve(launch.argv[0], list(launch.argv), launch.env)
    os.environ.clear()
    os.environ.update(launch.env)
    for entry in reversed(launch.env.get("PYTHONPATH", "").split(os.pathsep)):  # (the rest of sys.path: this one's)
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    if launch.env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [launch.module, *launch.args]
    try:
        runpy.run_module(launch.module, run_name="__main__", alter_sys=True)
    finally:  # as an interpreter ends: its threads joined, then its exit functions (multiprocessing skips these)
        threading._shutdown()
        atexit._run_exitfuncs()


def _let_the_forkserver_go() -> None:
    """Close the fork's copies of the descriptors that keep the forkserver and its resource tracker alive: they
    are to end with the launcher, not with its last service."""
    for holder, attribute in ((forkserver._forkserver, "_forkserver_alive_fd"),
                              (resource_tracker._resource_tracker, "_fd")):
        fd = getattr(holder, attribute, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(holder, attribute, None)


def _show_command_line(argv: Sequence[str]) -> None:
    """`ps` and /proc/PID/cmdline show the command line the fork stands for, not the forkserver's."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(argv))
