"""Supervised child processes: restart the ones that die, stop them all cleanly.

Each child runs in its own process group (its own session, in fact), with
stdout and stderr copied into `LOG_DIR/NAME.log`, rotated by size (see
`log_files`), so:

- Ctrl-C in the launcher's terminal reaches only the launcher, which then
  stops the children in order instead of them all dying at once;
- stopping a child signals its whole group, so its own children go too;
- a child also gets SIGTERM if the launcher itself dies (Linux).

The restart policy is a handful of pure functions over a `RestartPolicy`
(tested on their own); `Supervisor` applies them. The supervisor is driven by
`poll()`, called from the owner's loop; its only threads copy the children's
output into their logs.
"""

from __future__ import annotations

import datetime
import enum
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher.log_files import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, RotatingLog
from services.launcher.procs import (
    describe_exit,
    group_members,
    parent_death_signal_preexec,
    process_start_time,
    signal_group,
)
from services.launcher.service_spawner import ServiceSpawner, SpawnedService

# ---------------------------------------------------------------------------
# Policy: pure functions.


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a child that died is started again.

    After the n-th consecutive failure the child waits
    `min(max_delay_s, base_delay_s * factor ** (n - 1))`. A run that lasted at
    least `stable_after_s` resets the count. A child that already had
    `max_restarts` restarts within the last `window_s` seconds and dies again
    is marked failed (the rest keep running); it is tried again every
    `failed_retry_s` seconds (None: never), and stays failed until one of those
    runs lasts `stable_after_s`.
    """

    base_delay_s: float = 0.5
    factor: float = 2.0
    max_delay_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 60.0
    stable_after_s: float = 30.0
    failed_retry_s: float | None = 60.0

    def __post_init__(self) -> None:
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("restart delays must be >= 0")
        if self.factor < 1:
            raise ValueError("backoff factor must be >= 1")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.failed_retry_s is not None and self.failed_retry_s < 0:
            raise ValueError("failed_retry_s must be >= 0")


def backoff_delay(failures: int, policy: RestartPolicy) -> float:
    """Seconds to wait before restarting after `failures` consecutive failures (1 = first)."""
    exponent = min(max(failures, 1) - 1, 64)  # 2**64 is already far past any cap
    return min(policy.max_delay_s, policy.base_delay_s * policy.factor**exponent)


def consecutive_failures(previous: int, uptime_s: float, policy: RestartPolicy) -> int:
    """The failure count after a child died having run `uptime_s` seconds."""
    return 1 if uptime_s >= policy.stable_after_s else previous + 1


def recent_restarts(restart_times: Iterable[float], now: float, policy: RestartPolicy) -> list[float]:
    """The restart times still inside the window ending at `now`."""
    return [t for t in restart_times if now - t < policy.window_s]


def should_give_up(restart_times: Iterable[float], now: float, policy: RestartPolicy) -> bool:
    """True if a child that just died has used up its restarts for the window."""
    return len(recent_restarts(restart_times, now, policy)) >= policy.max_restarts


# ---------------------------------------------------------------------------
# The supervisor.


class ChildState(str, enum.Enum):
    PENDING = "pending"  # added, not started yet
    RUNNING = "running"
    RESTARTING = "restarting"  # died; waiting out its backoff
    FAILED = "failed"  # died too often; tried again only every `failed_retry_s`
    STOPPING = "stopping"
    STOPPED = "stopped"


class SupervisorError(RuntimeError):
    """A child could not be added or started."""


@dataclass
class SupervisorEvent:
    """Something the owner may want to report: `exited`, `restarted`, `gave_up` (marked failed)."""

    kind: str
    name: str
    message: str
    exit_code: int | None = None
    delay_s: float | None = None


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: str | None = None
    role: str | None = None
    instance_id: str | None = None
    state: ChildState = ChildState.PENDING
    process: subprocess.Popen | SpawnedService | None = field(default=None, repr=False)
    log: RotatingLog | None = field(default=None, repr=False)
    log_thread: threading.Thread | None = field(default=None, repr=False)
    pid: int | None = None
    start_time: int | None = None  # clock ticks since boot, from /proc
    restarts: int = 0
    exit_code: int | None = None  # of the last run that ended
    failures: int = 0  # consecutive, for the backoff
    restart_times: list[float] = field(default_factory=list)
    started_at: float | None = None  # supervisor clock
    next_start_at: float | None = None
    killed: bool = False  # stop() had to SIGKILL it
    gave_up: bool = False  # marked failed, and no run has lasted `stable_after_s` since

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Supervisor:
    """Named child processes, restarted when they die, stopped together.

    `env` given to `add` is merged over the launcher's environment. Call
    `poll()` regularly (every 0.1-0.5 s): it notices exits and performs due
    restarts, and returns what happened as events.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        policy: RestartPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        parent_death_signal: int | None = signal.SIGTERM,
        log_max_bytes: int = DEFAULT_MAX_BYTES,
        log_backups: int = DEFAULT_BACKUPS,
        spawner: ServiceSpawner | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.policy = policy or RestartPolicy()
        self._clock = clock
        self._preexec = parent_death_signal_preexec(parent_death_signal) if parent_death_signal else None
        self._death_signal = parent_death_signal
        self._spawner = spawner
        self._children: dict[str, Child] = {}
        self._stopping = False

    # -- setup ----------------------------------------------------------------

    def add(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        role: str | None = None,
        instance_id: str | None = None,
    ) -> Child:
        if not _NAME.match(name):
            raise SupervisorError(f"child name {name!r} may only contain letters, digits, '.', '_' and '-'")
        if name in self._children:
            raise SupervisorError(f"a child named {name!r} already exists")
        if not argv:
            raise SupervisorError(f"child {name!r} has an empty command line")
        child = Child(
            name=name,
            argv=[str(a) for a in argv],
            log_path=self.log_dir / f"{name}.log",
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd is not None else None,
            role=role,
            instance_id=instance_id,
        )
        self._children[name] = child
        return child

    def start(self, *names: str) -> None:
        """Start the named children, or every pending one. Raises if one cannot start."""
        if self._stopping:
            raise SupervisorError("the supervisor is stopping")
        targets = [self.child(n) for n in names] if names else [c for c in self._children.values() if c.state == ChildState.PENDING]
        for child in targets:
            if child.running:
                continue
            try:
                self._spawn(child)
            except OSError as exc:
                raise SupervisorError(f"cannot start {child.name} ({child.argv[0]}): {exc.strerror or exc}") from exc

    # -- inspection -----------------------------------------------------------

    @property
    def children(self) -> list[Child]:
        return list(self._children.values())

    def child(self, name: str) -> Child:
        try:
            return self._children[name]
        except KeyError:
            raise SupervisorError(f"no child named {name!r}") from None

    def failed(self) -> list[Child]:
        return [c for c in self._children.values() if c.state == ChildState.FAILED]

    # -- running ----------------------------------------------------------------

    def _spawn(self, child: Child) -> None:
        env = None
        if child.env is not None:
            env = dict(os.environ)
            env.update(child.env)
        attempt = f"restart {child.restarts}" if child.restarts else "start"
        self._log_note(child, f"{attempt} of {child.name}: {' '.join(child.argv)}")
        process = self._fork(child, env) or subprocess.Popen(
            child.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=child.cwd,
            start_new_session=True,  # own session and process group: pgid == pid
            preexec_fn=self._preexec,
            close_fds=True,
        )
        child.log_thread = child.log.follow(process.stdout, child.name)
        child.process = process
        child.pid = process.pid
        child.start_time = process_start_time(process.pid)
        child.state = ChildState.RUNNING
        child.started_at = self._clock()
        child.next_start_at = None
        child.killed = False

    def _fork(self, child: Child, env: dict[str, str] | None) -> SpawnedService | None:
        """A `python -m services.*` child forked off the preloaded spawner (see service_spawner), its output on a
        pipe as a Popen's; None for a command to start the usual way."""
        if self._spawner is None:
            return None
        read, write = os.pipe()
        try:
            process = self._spawner.spawn(child.argv, env=env, cwd=child.cwd, output_fd=write,
                                          death_signal=self._death_signal)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        if process is None:
            os.close(read)
            return None
        process.stdout = os.fdopen(read, "rb")
        return process

    def _log_note(self, child: Child, text: str) -> None:
        if child.log is None:
            child.log = RotatingLog(child.log_path, self.log_max_bytes, self.log_backups)
        try:
            child.log.write(f"--- {_now_iso()} splitserve supervisor: {text}")
        except OSError:
            pass

    @staticmethod
    def _flush_log(child: Child, timeout_s: float = 2.0) -> None:
        """Wait until what the child wrote before it ended is in its log (its pipe closes with its group)."""
        if child.log_thread is not None:
            child.log_thread.join(timeout_s)

    def poll(self) -> list[SupervisorEvent]:
        """Notice children that died and restart the ones whose backoff is over."""
        events: list[SupervisorEvent] = []
        if self._stopping:
            return events
        now = self._clock()
        for child in list(self._children.values()):
            if child.state == ChildState.STOPPING:
                event = self._poll_retiring(child, now)
                events += [event] if event is not None else []
                continue
            if child.state == ChildState.RUNNING and child.process is not None:
                code = child.process.poll()
                if code is None:
                    continue
                events.append(self._on_exit(child, code, now))
            waiting = child.state in (ChildState.RESTARTING, ChildState.FAILED)
            if waiting and child.next_start_at is not None and now >= child.next_start_at:
                events.append(self._restart(child, now))
        return events

    def retire(self, name: str, timeout_s: float) -> None:
        """Stop one child for good: SIGTERM to its group now, SIGKILL after `timeout_s`; `poll` removes it once its
        group is gone (a `retired` event). One that does not run is removed at once."""
        child = self.child(name)
        if not child.running:
            self._forget(child)
            return
        child.state = ChildState.STOPPING
        child.next_start_at = self._clock() + max(timeout_s, 0.0)  # its SIGKILL, while stopping
        self._log_note(child, f"{child.name} is retired: SIGTERM")
        signal_group(child.pid, signal.SIGTERM)

    def _forget(self, child: Child) -> None:
        self._flush_log(child, timeout_s=1.0)
        if child.log is not None:
            child.log.close()
        del self._children[child.name]

    def _poll_retiring(self, child: Child, now: float) -> SupervisorEvent | None:
        """A retired child gone: removed (its group's leftovers killed); past its deadline: SIGKILL."""
        code = child.process.poll() if child.process is not None else 0
        if code is None:
            if child.next_start_at is not None and now >= child.next_start_at and not child.killed:
                child.killed = True
                self._log_note(child, f"{child.name} did not stop in time; SIGKILL")
                signal_group(child.pid, signal.SIGKILL)
            return None
        signal_group(child.pid, signal.SIGKILL)
        child.exit_code, child.state = code, ChildState.STOPPED
        self._log_note(child, f"{child.name} {describe_exit(code)}; retired")
        self._forget(child)
        return SupervisorEvent("retired", child.name, f"{child.name} {describe_exit(code)}; retired", exit_code=code)

    def _on_exit(self, child: Child, code: int, now: float) -> SupervisorEvent:
        # Whatever the child left behind in its group goes with it.
        signal_group(child.pid, signal.SIGKILL)
        self._flush_log(child)
        child.exit_code = code
        uptime = now - (child.started_at if child.started_at is not None else now)
        if uptime >= self.policy.stable_after_s:
            child.gave_up = False
        child.failures = consecutive_failures(child.failures, uptime, self.policy)
        child.restart_times = recent_restarts(child.restart_times, now, self.policy)
        how = describe_exit(code)
        if child.gave_up or should_give_up(child.restart_times, now, self.policy):
            child.gave_up = True
            child.state = ChildState.FAILED
            retry = self.policy.failed_retry_s
            child.next_start_at = now + retry if retry is not None else None
            message = (
                f"{child.name} {how}; it was restarted {len(child.restart_times)} times in the last "
                f"{self.policy.window_s:g} s, so it is marked failed"
                + (f" and tried again in {retry:g} s" if retry is not None else " and not restarted")
            )
            self._log_note(child, message)
            return SupervisorEvent("gave_up", child.name, message, exit_code=code,
                                   delay_s=retry)
        delay = backoff_delay(child.failures, self.policy)
        child.state = ChildState.RESTARTING
        child.next_start_at = now + delay
        message = f"{child.name} {how}; restarting in {delay:g} s"
        self._log_note(child, message)
        return SupervisorEvent("exited", child.name, message, exit_code=code, delay_s=delay)

    def _restart(self, child: Child, now: float) -> SupervisorEvent:
        child.restarts += 1
        child.restart_times.append(now)
        try:
            self._spawn(child)
        except OSError as exc:
            # Counts as a run that died at once: same backoff and give-up rules.
            child.process = None
            child.started_at = now
            child.state = ChildState.RUNNING
            event = self._on_exit(child, 127, now)
            event.message = f"{child.name} could not be restarted ({exc.strerror or exc}); " + event.message.split("; ", 1)[1]
            return event
        return SupervisorEvent("restarted", child.name, f"{child.name} restarted (pid {child.pid}, restart {child.restarts})")

    def run_for(self, seconds: float, interval: float = 0.05) -> list[SupervisorEvent]:
        """Poll for `seconds`; handy in tests and simple owners."""
        events: list[SupervisorEvent] = []
        deadline = time.monotonic() + seconds
        while True:
            events += self.poll()
            left = deadline - time.monotonic()
            if left <= 0:
                return events
            time.sleep(min(interval, left))

    # -- stopping -------------------------------------------------------------

    def stop(self, timeout_s: float = 10.0) -> dict[str, int | None]:
        """SIGTERM every child's process group, wait, SIGKILL what is left.

        Returns after at most about `timeout_s` seconds with no process of any
        child's group left running. The result maps each child to its exit
        code (None for one that never ran). Safe to call twice.
        """
        self._stopping = True
        start = time.monotonic()
        deadline = start + max(timeout_s, 0.0)
        # Keep a slice of the time for SIGKILL and reaping.
        term_deadline = deadline - min(1.0, 0.2 * max(timeout_s, 0.0))
        groups: dict[str, int] = {}
        for child in self._children.values():
            if child.pid is not None and (child.running or group_members(child.pid)):
                groups[child.name] = child.pid
                if child.running:
                    child.state = ChildState.STOPPING
                signal_group(child.pid, signal.SIGTERM)
            elif child.state != ChildState.FAILED:
                child.state = ChildState.STOPPED

        def unfinished() -> list[Child]:
            left = []
            for name in groups:
                child = self._children[name]
                # Reap the leader first: a zombie still counts as a group member.
                if child.running or group_members(groups[name]):
                    left.append(child)
            return left

        left = unfinished()
        while left and time.monotonic() < term_deadline:
            time.sleep(0.05)
            left = unfinished()
        for child in left:
            child.killed = True
            self._log_note(child, f"{child.name} did not stop within {timeout_s:g} s; SIGKILL")
            signal_group(groups[child.name], signal.SIGKILL)
        for child in self._children.values():
            if child.process is not None:
                try:
                    child.process.wait(timeout=max(deadline - time.monotonic(), 0.5))
                except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                    child.process.kill()
                    child.process.wait()
                child.exit_code = child.process.returncode
            if child.state != ChildState.FAILED:
                child.state = ChildState.STOPPED
        # Orphaned grandchildren die from SIGKILL at once, but are only gone
        # from /proc once their new parent reaps them.
        while any(group_members(pgid) for pgid in groups.values()) and time.monotonic() < deadline + 1.0:
            time.sleep(0.02)
        for child in self._children.values():
            self._flush_log(child, timeout_s=1.0)
            if child.log is not None:
                child.log.close()
        return {c.name: c.exit_code for c in self._children.values()}

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
