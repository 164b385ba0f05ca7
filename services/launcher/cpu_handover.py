"""Handing CPUs over between the workers of a running deployment, never two workers on one CPU at once.

When workers are added or removed the launcher shares the CPUs out again (`share_cpus`) and moves the workers
that stay through their placement files (`services.common.cpu_placement`, followed by
`services.common.cpu_follow`). `handover_steps` says in what order, as rounds: the steps of one round may be
taken together, and a round starts only once every step of the round before it is acked (a placement's ack in
FILE.ack; a started worker's first ack, which it writes as it starts; a stopped worker's exit). The first round
stops the removed workers and shrinks each worker that stays to the CPUs it keeps; each later round moves the
workers whose new CPUs nobody holds any more, and starts the added ones there.

A decode worker that borrows an idle prefill worker's CPU (`services.common.cpu_loan`) holds that CPU too: its
loan follows its lender's CPUs (`loan_cpus`), and shares it with that lender only (their loan file's lock
decides which of the two runs there). A borrower lets go of a lent CPU before it goes to a third worker.

Two workers that would trade CPUs (each to the other's) can never move without one stepping on the other:
`HandoverError`. So can shares that overlap (fewer CPUs than workers): a placement to follow has a CPU to
itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class HandoverError(ValueError):
    pass


@dataclass(frozen=True)
class Step:
    action: Literal["stop", "place", "start"]
    worker: str
    cpus: tuple[int, ...] = ()
    borrow_cpus: tuple[int, ...] = ()  # a borrower's: the CPUs it may borrow (its lender's)


@dataclass(frozen=True)
class _Hold:
    cpus: tuple[int, ...]
    borrow_cpus: tuple[int, ...] = ()
    lender: str | None = None  # whose CPUs borrow_cpus are


def loan_cpus(lender_cpus: tuple[int, ...], borrower_cpus: tuple[int, ...]) -> tuple[int, ...]:
    """What a decode worker borrows from its lender: the lender's CPU when each of the two has one CPU of its own
    (the loans `cpu_loan` runs), else none."""
    if len(lender_cpus) == 1 and len(borrower_cpus) == 1 and lender_cpus != borrower_cpus:
        return lender_cpus
    return ()


def _holds(shares: dict[str, tuple[int, ...]], loans: dict[str, str]) -> dict[str, _Hold]:
    holds = {}
    for worker, cpus in shares.items():
        lender = loans.get(worker)
        borrowed = loan_cpus(shares[lender], cpus) if lender in shares else ()
        holds[worker] = _Hold(tuple(cpus), borrowed, lender if borrowed else None)
    return holds


def _clash(worker: str, hold: _Hold, held: dict[str, _Hold]) -> set[int]:
    """The CPUs of `hold` that another worker holds (a lent CPU shared with its own lender is not a clash)."""
    clash: set[int] = set()
    for other, theirs in held.items():
        if other == worker:
            continue
        clash |= set(hold.cpus) & (set(theirs.cpus) | set(theirs.borrow_cpus) if theirs.lender != worker
                                   else set(theirs.cpus))
        if hold.lender != other:
            clash |= set(hold.borrow_cpus) & set(theirs.cpus)
    return clash


def _check_disjoint(holds: dict[str, _Hold], which: str) -> None:
    for worker, hold in holds.items():
        if clash := _clash(worker, hold, holds):
            raise HandoverError(f"the {which} shares overlap (CPUs {sorted(clash)} of {worker}): a worker to move at "
                                "runtime needs CPUs of its own")


def _kept(now: _Hold, target: _Hold) -> _Hold:
    """What a worker keeps while the others move: its CPUs that stay its own (all of them if none does), and a lent
    CPU only while it is lent by the same lender."""
    cpus = tuple(c for c in now.cpus if c in target.cpus) or now.cpus
    same_loan = now.lender == target.lender
    borrowed = tuple(c for c in now.borrow_cpus if same_loan and c in target.borrow_cpus)
    return _Hold(cpus, borrowed, now.lender if borrowed else None)


def handover_steps(old: dict[str, tuple[int, ...]], new: dict[str, tuple[int, ...]],
                   old_loans: dict[str, str] | None = None,
                   new_loans: dict[str, str] | None = None) -> list[list[Step]]:
    """The rounds that take the workers from their `old` CPUs to their `new` (workers only in `old` stop, workers
    only in `new` start); `*_loans`: borrower -> lender. HandoverError when no order avoids sharing a CPU."""
    held, target = _holds(old, old_loans or {}), _holds(new, new_loans or {})
    _check_disjoint(held, "old")
    _check_disjoint(target, "new")
    first = [Step("stop", w) for w in held if w not in target]
    held = {w: hold for w, hold in held.items() if w in target}
    for worker, hold in held.items():
        kept = _kept(hold, target[worker])
        if kept != hold:
            first.append(Step("place", worker, kept.cpus, kept.borrow_cpus))
            held[worker] = kept
    rounds = [first] if first else []
    while pending := [w for w in target if held.get(w) != target[w]]:
        ready = [w for w in pending if not _clash(w, target[w], held)]
        if not ready:
            raise HandoverError(f"{', '.join(pending)} would each take CPUs another of them holds: no order hands "
                                "them over without two workers on one CPU (keep workers where they are)")
        rounds.append([Step("place" if w in held else "start", w, target[w].cpus, target[w].borrow_cpus)
                       for w in ready])
        held |= {w: target[w] for w in ready}
    return rounds


class Handover:
    """A handover in progress, advanced by the launcher's main loop: pure (the caller takes the steps and says
    how each stands).

    `advance(now, status)` returns the steps to take now: a round's steps once the round before it is done.
    `status(step)` says how a step taken stands: True done (a placement's ack naming it; a started worker's
    first ack; a stopped worker gone), a string why it was refused, None not yet. A refusal, or a round not done
    by its deadline, ends the handover (`failed` says which and why): nothing more moves, every worker stays
    where it last acked (`held`), and the workers still to start are `unstarted()`."""

    def __init__(self, rounds: list[list[Step]], held: dict[str, tuple[int, ...]], timeouts: list[float]) -> None:
        self.rounds = rounds
        self.timeouts = timeouts  # each round's
        self.held = dict(held)  # each worker's CPUs as last acked (a stopped one leaves)
        self.round = -1  # the round under way
        self.awaiting: dict[str, Step] = {}
        self.deadline = 0.0
        self.failed = ""

    @property
    def done(self) -> bool:
        return not self.failed and not self.awaiting and self.round >= len(self.rounds) - 1

    @property
    def over(self) -> bool:
        return bool(self.failed) or self.done

    def unstarted(self) -> list[str]:
        """The workers to start in rounds not begun (after a failure: those to start as before a handover)."""
        return [s.worker for r in self.rounds[self.round + 1:] for s in r if s.action == "start"]

    def advance(self, now: float, status) -> list[Step]:
        if self.over:
            return []
        for worker, step in list(self.awaiting.items()):
            outcome = status(step)
            if outcome is True:
                del self.awaiting[worker]
                if step.action == "stop":
                    self.held.pop(worker, None)
                else:
                    self.held[worker] = step.cpus
            elif isinstance(outcome, str):
                self.failed = f"{worker} refused CPUs {','.join(map(str, step.cpus))} ({step.action}): {outcome}"
                return []
        if self.awaiting:
            if now >= self.deadline:
                late = ", ".join(f"{w} ({s.action})" for w, s in self.awaiting.items())
                self.failed = f"no answer within {self.timeouts[self.round]:g} s from {late}"
            return []
        if self.round >= len(self.rounds) - 1:
            return []
        self.round += 1
        steps = self.rounds[self.round]
        self.awaiting = {s.worker: s for s in steps}
        self.deadline = now + self.timeouts[self.round]
        return steps

    def refuse(self, step: Step, why: str) -> None:
        """A step the caller could not take (e.g. a worker that would not start)."""
        self.awaiting.pop(step.worker, None)
        if not self.failed:
            self.failed = f"{step.worker} ({step.action}): {why}"
