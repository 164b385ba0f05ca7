"""The order a running deployment's CPUs are handed over in: never two workers on one CPU, given the acks."""

import itertools

import pytest

from services.common.cpus import share_cpus
from services.launcher.cpu_handover import HandoverError, Step, handover_steps, loan_cpus


def place(worker, cpus, borrow=()):
    return Step("place", worker, cpus, borrow)


def start(worker, cpus, borrow=()):
    return Step("start", worker, cpus, borrow)


CASES = {
    "nothing changes": ({"a": (0, 1)}, {"a": (0, 1)}, {}, []),
    "a worker added: the others shrink, then it starts": (
        {"a": (0, 1), "b": (2, 3)}, {"a": (0,), "b": (2,), "c": (1,), "d": (3,)}, {},
        [[place("a", (0,)), place("b", (2,))], [start("c", (1,)), start("d", (3,))]]),
    "a worker removed: it stops, then the others grow": (
        {"a": (0,), "b": (1,), "c": (2, 3)}, {"a": (0, 1), "b": (2, 3)}, {},
        [[Step("stop", "c")], [place("b", (2, 3))], [place("a", (0, 1))]]),
    "a chain: each waits for the one ahead of it to leave": (
        {"a": (0,), "b": (1,), "c": (2,)}, {"a": (1,), "b": (2,), "c": (3,)}, {},
        [[place("c", (3,))], [place("b", (2,))], [place("a", (1,))]]),
    "a worker keeps what stays its own while it waits": (
        {"a": (0, 1), "b": (2, 3)}, {"a": (1, 2), "b": (3, 4)}, {},
        [[place("a", (1,)), place("b", (3,))], [place("a", (1, 2)), place("b", (3, 4))]]),
}


@pytest.mark.parametrize("old, new, loans, rounds", CASES.values(), ids=CASES.keys())
def test_the_rounds(old, new, loans, rounds):
    assert handover_steps(old, new, loans, loans) == rounds


def test_trading_cpus_has_no_safe_order():
    with pytest.raises(HandoverError, match="a, b would each take"):
        handover_steps({"a": (0,), "b": (1,)}, {"a": (1,), "b": (0,)})


def test_overlapping_shares_are_refused():
    with pytest.raises(HandoverError, match="new shares overlap"):
        handover_steps({"a": (0,)}, {"a": (0,), "b": (0,)})


LOANS = {
    # A lender moves: its borrower lets go of the old CPU first, and borrows the new one once it is the lender's.
    "the loan follows the lender": (
        {"p": (0,), "d": (1,)}, {"p": (2,), "d": (1,), "x": (0,)},
        [[place("d", (1,))], [place("p", (2,)), place("d", (1,), (2,))], [start("x", (0,))]]),
    # The lender now has two CPUs: no loan `cpu_loan` runs; the borrower lets go before a CPU goes elsewhere.
    "a lender with two CPUs lends none": (
        {"p": (0,), "d": (1,), "x": (2, 3)}, {"p": (0, 3), "d": (1,), "x": (2,)},
        [[place("d", (1,)), place("x", (2,))], [place("p", (0, 3))]]),
    "a lender removed: the loan ends as it stops": (
        {"p": (0,), "d": (1,)}, {"d": (0, 1)},
        [[Step("stop", "p"), place("d", (1,))], [place("d", (0, 1))]]),
}


@pytest.mark.parametrize("old, new, rounds", LOANS.values(), ids=LOANS.keys())
def test_loans(old, new, rounds):
    assert handover_steps(old, new, {"d": "p"}, {"d": "p"}) == rounds


def test_a_borrower_holds_its_lent_cpu_against_everyone_but_its_lender():
    # x may have p's CPU 0 only once d no longer borrows it.
    rounds = handover_steps({"p": (0,), "d": (1,)}, {"p": (2,), "d": (1,), "x": (0,)}, {"d": "p"}, {"d": "p"})
    assert [step.worker for step in rounds[-1]] == ["x"]
    assert loan_cpus((0,), (1,)) == (0,) and loan_cpus((0, 2), (1,)) == () and loan_cpus((0,), (1, 3)) == ()


def _holders(rounds_so_far, old, loans):
    """CPU -> the workers that may run on it after the given steps (a borrower on its lent CPU included)."""
    holds = {w: (cpus, loan_cpus(old[loans[w]], cpus) if loans.get(w) in old else ()) for w, cpus in old.items()}
    for step in rounds_so_far:
        if step.action == "stop":
            holds.pop(step.worker)
        else:
            holds[step.worker] = (step.cpus, step.borrow_cpus)
    return holds


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2), (1, 4), (4, 1), (3, 5), (5, 3)])
def test_rescaling_a_shared_deployment_never_puts_two_workers_on_one_cpu(before, after):
    """The steps of a round land in any order: every subset of a round, on top of the rounds before, is checked."""
    cpus = tuple(range(8))
    old = share_cpus([f"w{i}" for i in range(before)], cpus)
    new = share_cpus([f"w{i}" for i in range(after)], cpus)
    done: list[Step] = []
    for round_ in handover_steps(old, new):
        for size in range(len(round_) + 1):
            for landed in itertools.combinations(round_, size):
                holds = _holders(done + list(landed), old, {})
                taken = [cpu for cpus, borrowed in holds.values() for cpu in cpus + borrowed]
                assert len(taken) == len(set(taken)), (done, landed)
        done += round_
    assert {w: cpus for w, (cpus, _) in _holders(done, old, {}).items()} == new
