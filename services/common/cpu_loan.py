"""A prefill worker's CPUs lent to a decode worker on the same host while the prefill worker is idle.

Disaggregation on one host gives each pool its own cores (`services.common.cpus`), so a
decode step only ever runs on the decode worker's share, even while the prefill
worker's cores sit idle between jobs. A loan lets the decode worker run its steps
on both shares while the prefill worker has nothing to compute, and hands the
lent CPUs back before the prefill worker computes again, so a prefill never
shares a core with a decode step (that made every decode step wait: on 2 cores a
shared core took the short-request p99 ITL from ~270 ms to ~1,000 ms).

The two processes meet in one small file (the loan), which the lender creates:

- byte 0 is the lender's demand: 1 while it has work or is about to;
- an flock on the file is the CPUs themselves: the borrower holds a shared lock
  for as long as it runs steps on the lent CPUs, the lender an exclusive lock
  while it computes. The kernel makes the two exclusive, and drops a dead
  process's lock, so a worker killed mid-step never keeps the CPUs.

The borrower looks at the demand byte before each step (one `pread`) and gives the
CPUs back within one step; the lender waits for that up to a deadline and then
computes anyway (counted as `overdue`). The byte only tells the borrower when to
let go: the lock alone decides who runs, so a stale or racing byte costs at most
one step's overlap, never two owners.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from shared.private_files import private_dir
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

DEFAULT_CLAIM_DEADLINE_S = 0.5  # past this the lender computes beside a borrower that did not let go
_POLL_S = 0.001


@dataclass
class LoanCounts:
    lent: int = 0  # times the borrower took the CPUs
    returned: int = 0  # times it gave them back at the lender's demand
    claims: int = 0  # times the lender took its CPUs back
    overdue: int = 0  # claims that passed their deadline (the lender computed beside the borrower)
    claim_wait_s: float = 0.0  # the lender's total wait for the borrower to let go

    def snapshot(self) -> dict:
        return {"lent": self.lent, "returned": self.returned, "claims": self.claims, "overdue": self.overdue,
                "claim_wait_s": round(self.claim_wait_s, 4)}


def _try_flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class CpuShare(Protocol):
    """What the engine loop calls on its thread: `start()` once, `before_step()` before each step, `idle()`
    whenever it has nothing to run."""

    def start(self) -> None: ...
    def before_step(self) -> None: ...
    def idle(self) -> None: ...
    def close(self) -> None: ...


class CpuLender:
    """The prefill worker's side: its CPUs are claimed before each step and lent while idle. Engine thread only."""

    def __init__(self, path: str | os.PathLike, deadline_s: float = DEFAULT_CLAIM_DEADLINE_S):
        self.path = Path(path)
        self.deadline_s = deadline_s
        # Whether the rest of the worker is quiet too (set by it): while it still ships KV or writes blocks back,
        # its event loop runs on these CPUs, and a borrower's OpenMP thread there would wait on it at every barrier.
        self.quiet: Callable[[], bool] = lambda: True
        self.counts = LoanCounts()
        # Opened in place, never replaced: a borrower that opened it before this worker (re)started locks the
        # same file. Demand is on until this worker first goes idle (it is loading).
        private_dir(self.path.parent)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(self._fd, 0o600)
        os.pwrite(self._fd, b"\x01", 0)
        self._locked = False
        self._demanding = True
        self._overdue = False

    def start(self) -> None:
        pass

    def before_step(self) -> None:
        self.claim()

    def idle(self) -> None:
        if self.quiet():
            self.release()  # else kept; the engine loop says idle again within its idle wait

    def claim(self) -> None:
        """Take the CPUs back: ask, then wait for the borrower's lock (at most `deadline_s` a claim)."""
        if self._locked:
            return
        if not self._demanding:
            os.pwrite(self._fd, b"\x01", 0)
            self._demanding = True
        if self._overdue:  # this claim has had its wait: take the lock as soon as it is free, never wait again
            self._try_lock()
            return
        self.counts.claims += 1
        started = time.monotonic()
        while not self._try_lock() and time.monotonic() - started < self.deadline_s:
            time.sleep(_POLL_S)
        self.counts.claim_wait_s += time.monotonic() - started
        if not self._locked:
            self._overdue = True
            self.counts.overdue += 1
            log.info("computing beside a decode step: the lent CPUs did not come back in time",
                     deadline_s=self.deadline_s)

    def release(self) -> None:
        """Lend the CPUs again (this worker has nothing to compute)."""
        self._overdue = False
        if self._demanding:
            os.pwrite(self._fd, b"\x00", 0)
            self._demanding = False
        if self._locked:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._locked = False

    def _try_lock(self) -> bool:
        self._locked = _try_flock(self._fd, fcntl.LOCK_EX)
        return self._locked

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops its lock too
            self._fd = None


@dataclass
class CpuBorrower:
    """The decode worker's side: `before_step()` before each step, `idle()` when it has nothing to run.

    One CPU of its own and one lent (`check_borrowing`). Engine thread only: the thread count it sets is that
    thread's OpenMP team size. Why one and one: libgomp keeps a team's threads between parallel regions only
    while no region asks for fewer threads than the team has but more than one; a smaller region ends the
    extra threads, and those started again come from the engine thread, pinned to its own CPUs, so a team
    wider than 2 would stack threads on the worker's own CPUs. Wider loans need each team thread pinned at
    every borrow and give-back (not built)."""

    path: Path
    own: tuple[int, ...]
    lent: tuple[int, ...]
    counts: LoanCounts = field(default_factory=LoanCounts)
    _fd: int | None = field(default=None, init=False)
    _borrowing: bool = field(default=False, init=False)
    _team: tuple[int, ...] = field(default=(), init=False)  # the thread ids of the OpenMP team's other threads

    def before_step(self) -> None:
        if self._borrowing:
            if self._demanded():
                self._give_back()
                self.counts.returned += 1
        elif self.lent and not self._demanded() and _try_flock(self._fd, fcntl.LOCK_SH):
            torch.set_num_threads(len(self.own) + len(self.lent))
            self._borrowing = True
            self.counts.lent += 1

    def idle(self) -> None:
        """Nothing to run: the lender may have its CPUs without waiting for a step."""
        if self._borrowing:
            self._give_back()

    def _give_back(self) -> None:
        torch.set_num_threads(len(self.own))
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._borrowing = False

    def _demanded(self) -> bool:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return True  # no lender yet (or it is starting): nothing to borrow
        return os.pread(self._fd, 1, 0) != b"\x00"

    def start(self) -> None:
        """Make the engine thread's OpenMP team at its full size with its other thread allowed on the lent CPU,
        then run the engine thread on this worker's own CPU and one thread: the process (the model's load
        included) never leaves its own CPU, and only the team's other thread runs on the lent one."""
        before = set(os.listdir("/proc/self/task"))
        os.sched_setaffinity(0, (*self.own, *self.lent))  # 0: the calling thread only; a thread it starts inherits it
        torch.set_num_threads(len(self.own) + len(self.lent))
        torch.mm(torch.ones(256, 256), torch.ones(256, 256))  # a parallel region: the team at its full size
        self._team = tuple(int(task) for task in set(os.listdir("/proc/self/task")) - before)
        os.sched_setaffinity(0, self.own)
        torch.set_num_threads(len(self.own))

    def move(self, own: tuple[int, ...], lent: tuple[int, ...]) -> None:
        """Runtime placement (`services.common.cpu_follow`), after every thread was moved to `own`: give the
        loan back if held, then borrow `lent` (the lender's CPUs now; empty: none) from the next step on, the
        team's other thread allowed on them again. Engine thread only."""
        if self._borrowing:
            self._give_back()
        self.own, self.lent = own, lent
        torch.set_num_threads(len(own))
        for task in self._team:
            try:
                os.sched_setaffinity(task, (*own, *lent))
            except ProcessLookupError:  # libgomp ended it; one started again comes from the engine thread (own)
                pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def loan_details(share: CpuShare | None) -> dict:
    """A worker's loan figures for its stats (empty without a loan)."""
    return {} if share is None else {"role": "borrower" if isinstance(share, CpuBorrower) else "lender",
                                     **share.counts.snapshot()}


def check_borrowing(own: tuple[int, ...] | None, lent: tuple[int, ...] | None, loan: str | None) -> None:
    """ValueError unless a decode worker's borrowing flags make a loan this module can run (see `CpuBorrower`)."""
    if not lent or not own or not loan:
        raise ValueError("--borrow-cpus needs --cpus (this worker's own) and --cpu-loan, and --cpu-loan on a decode "
                         "worker needs --borrow-cpus")
    if set(own) & set(lent):
        raise ValueError("--borrow-cpus must not overlap --cpus")
    if len(own) != 1 or len(lent) != 1:
        raise ValueError("a decode worker borrows one CPU beside one of its own (--cpus N --borrow-cpus M)")


def cpu_share_from_settings(settings) -> CpuShare | None:
    """A worker's side of its --cpu-loan (a decode worker's, with --borrow-cpus, borrows; a prefill worker's
    lends), or None. Make it before the model loads: a lender's demand is up from then on."""
    if not settings.cpu_loan:
        return None
    if hasattr(settings, "borrow_cpus"):
        return CpuBorrower(Path(settings.cpu_loan), own=settings.cpus, lent=settings.borrow_cpus)
    return CpuLender(settings.cpu_loan)
