"""Process helpers: liveness from /proc, process groups, parent-death signal.

Linux first (the launcher targets it); every helper degrades to a portable
fallback elsewhere.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on, or None if there is no such process."""
    try:
        data = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError, OSError):
        return None
    # Field 2 (comm) is in parentheses and may itself contain spaces or ')'.
    close = data.rfind(")")
    if close < 0:
        return None
    return data[close + 2:].split()


def process_start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat).

    Stored next to a pid, it tells a live process from a later one that reused
    the pid. None when the process does not exist or /proc is unavailable.
    """
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19])


def parent_pid(pid: int) -> int | None:
    """`pid`'s parent (field 4 of /proc/PID/stat), or None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None and len(fields) > 1 else None


def pid_alive(pid: int | None, start_time: int | None = None) -> bool:
    """True if `pid` is a running (not zombie) process, and it is the same
    process as the one that had `start_time`, when given."""
    if not pid or pid <= 0:
        return False
    if _PROC.is_dir():
        fields = _stat_fields(pid)
        if fields is None or fields[0] in ("Z", "X", "x"):
            return False
        return start_time is None or int(fields[19]) == start_time
    try:  # no /proc: signal 0 only says the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`."""
    if not _PROC.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # fields[0] is the state, fields[2] the process group (field 5).
        if fields is not None and fields[0] not in ("Z", "X", "x") and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def signal_group(pgid: int | None, sig: int) -> bool:
    """Send `sig` to every process in group `pgid`; False if the group is gone."""
    if not pgid or pgid <= 0:
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def set_parent_death_signal(sig: int) -> bool:
    """Ask for `sig` when this process's parent (the thread that forked it) dies. Linux only (prctl
    PR_SET_PDEATHSIG); False where it cannot be asked for."""
    prctl = _prctl()
    if prctl is None:
        return False
    pr_set_pdeathsig = 1
    return prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) == 0


@functools.cache
def _prctl():
    """libc's prctl, looked up once (a preexec_fn must not load libraries after the fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def parent_death_signal_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get `sig` when the launcher dies.

    So even a launcher killed with SIGKILL leaves no service running. Linux
    only; None elsewhere. The signal fires when the *thread* that spawned the
    child exits, so spawn from a long-lived thread.
    """
    if _prctl() is None:
        return None

    def preexec() -> None:
        set_parent_death_signal(sig)

    return preexec


def describe_exit(returncode: int | None) -> str:
    """'exited with code 3' or 'killed by SIGKILL'."""
    if returncode is None:
        return "did not start"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"
