"""A worker moved to other CPUs at runtime: it follows its placement file (--cpus-file) between engine steps.

When the launcher adds or removes a worker it shares the CPUs out again (`services.common.cpus.share_cpus`)
and hands each worker's changed CPUs over in an order that never has two workers on one CPU
(`services.launcher.cpu_handover`): it writes a worker's placement file (`services.common.cpu_placement`) and
waits for the worker's ack before it gives the CPUs that worker left to another.

The worker looks at the file's stat at most every POLL_S, from its engine thread before a step or while idle
(never inside one). On a new placement it moves every thread of the process (the engine thread, its OpenMP
team, the event loop, the rest) to the new CPUs, runs one torch thread per CPU, and acks. A placement naming
CPUs the worker may not use (`allowed_cpus`), or a loan it cannot run, is refused: logged once, nothing moved,
and the ack says why.

The loan follows the lender's CPUs: a borrower's file names what it borrows (its lender's CPUs now, or none
while the two are not one CPU each: `cpu_handover.loan_cpus`). On a change it gives back what it holds and
borrows the new CPUs from its next step. A lender's loan file is its CPUs whatever their numbers, so a lender
has nothing to change but its own threads.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from services.common.cpu_loan import CpuBorrower, CpuShare, cpu_share_from_settings, loan_details
from services.common.cpu_placement import Ack, Placement, parse_placement, write_ack
from services.common.cpus import allowed_cpus, format_cpu_list, pin_threads, usable_cpus
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

POLL_S = 0.05  # how often the engine thread looks at the placement file's stat, at most


def placement_problem(placement: Placement, allowed: tuple[int, ...], borrower: bool) -> str:
    """Why a worker cannot take `placement` ("" when it can): CPUs it may not use, or a loan it cannot run."""
    outside = sorted(set(placement.cpus + placement.borrow_cpus) - set(allowed))
    if outside:
        return (f"CPUs {format_cpu_list(tuple(outside))} are not available to this worker "
                f"(it may use {format_cpu_list(allowed)})")
    if placement.borrow_cpus and not borrower:
        return "borrow_cpus: this worker borrows no CPUs (it has no --borrow-cpus)"
    if placement.borrow_cpus and (len(placement.cpus), len(placement.borrow_cpus)) != (1, 1):
        return "a decode worker borrows one CPU beside one of its own (or none: empty borrow_cpus)"
    return ""


def _version(stat: os.stat_result) -> tuple[int, int, int]:
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


class CpuFollower:
    """A `CpuShare` that follows the placement file at `path`, around the worker's loan (`inner`), if any.
    Engine thread only."""

    def __init__(self, path: str | os.PathLike, inner: CpuShare | None = None, allowed: tuple[int, ...] | None = None,
                 poll_s: float = POLL_S):
        self.path = Path(path)
        self.inner = inner
        self.allowed = allowed if allowed is not None else allowed_cpus()
        self.poll_s = poll_s
        self.applied: Placement | None = None
        # Where it runs before its first placement (its --cpus; a borrower's loan): a move the kernel refuses goes back
        self._before = Placement(-1, usable_cpus(), getattr(inner, "lent", ()))
        self.changes = 0
        self.refused = 0
        self._seen: tuple[int, int, int] | None = None  # the file version read last: (mtime_ns, size, inode)
        self._next_look = 0.0

    def start(self) -> None:
        if self.inner is not None:
            self.inner.start()
        self.follow()

    def before_step(self) -> None:
        self.follow()
        if self.inner is not None:
            self.inner.before_step()

    def idle(self) -> None:
        self.follow()
        if self.inner is not None:
            self.inner.idle()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def follow(self) -> None:
        """Take the placement file's new version, if it has one (at most one look a POLL_S)."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + self.poll_s
        try:
            if _version(os.stat(self.path)) == self._seen:
                return
            with open(self.path) as fh:  # the version read is the one opened (the launcher replaces the file whole)
                self._seen = _version(os.fstat(fh.fileno()))  # each version once: a refused one is not refused again
                text = fh.read()
        except FileNotFoundError:
            return
        self._take(text)

    def _take(self, text: str) -> None:
        try:
            placement = parse_placement(text)
        except ValueError as exc:
            self._refuse(None, f"{self.path} is not a CPU placement: {exc}")
            return
        if placement == self.applied:  # the same placement written again: the same answer
            self._answer(Ack(placement.generation, True), placement)
            return
        if self.applied is not None and placement.generation <= self.applied.generation:
            self._refuse(placement.generation, f"generation {placement.generation} is not after the one applied "
                                               f"({self.applied.generation})")
            return
        problem = placement_problem(placement, self.allowed, isinstance(self.inner, CpuBorrower))
        if problem:
            self._refuse(placement.generation, problem)
            return
        try:
            self._move(placement)
        except OSError as exc:
            self._move(self.applied or self._before)
            self._refuse(placement.generation, f"the kernel refused the CPUs: {exc}")
            return
        self.applied = placement
        self.changes += 1
        self._answer(Ack(placement.generation, True), placement)
        log.info("moved to other CPUs", generation=placement.generation, cpus=format_cpu_list(placement.cpus),
                 borrow_cpus=format_cpu_list(placement.borrow_cpus))

    def _move(self, placement: Placement) -> None:
        pin_threads(placement.cpus)
        if isinstance(self.inner, CpuBorrower):
            self.inner.move(placement.cpus, placement.borrow_cpus)
        else:
            torch.set_num_threads(len(placement.cpus))  # this thread's (the engine's) OpenMP team

    def _refuse(self, generation: int | None, error: str) -> None:
        self.refused += 1
        log.warning("CPU placement refused: this worker stays where it is", generation=generation, error=error)
        self._answer(Ack(generation, False, error))

    def _answer(self, ack: Ack, placement: Placement | None = None) -> None:
        try:
            write_ack(self.path, ack, placement)
        except OSError as exc:  # the launcher waits on: its own deadline says so, and this worker serves on
            log.warning("could not answer the CPU placement", path=str(self.path), error=repr(exc))

    def details(self) -> dict:
        applied = self.applied
        return {"generation": None if applied is None else applied.generation,
                "cpus": None if applied is None else format_cpu_list(applied.cpus),
                "changes": self.changes, "refused": self.refused}


def engine_cpu_share(settings) -> CpuShare | None:
    """A worker's CPU share: its loan (`cpu_share_from_settings`), inside a follower of its --cpus-file if it has
    one. Make it before the model loads."""
    loan = cpu_share_from_settings(settings) if getattr(settings, "cpu_loan", None) else None
    if not getattr(settings, "cpus_file", None):
        return loan
    return CpuFollower(settings.cpus_file, inner=loan)


def cpu_share_details(share: CpuShare | None) -> dict:
    """A worker's loan figures and placement for its stats."""
    if isinstance(share, CpuFollower):
        return {"cpu_loan": loan_details(share.inner), "cpu_placement": share.details()}
    return {"cpu_loan": loan_details(share), "cpu_placement": {}}
