"""The launcher's CPU handover as its main loop runs it (`Handover`): pure; which steps happen when, as acks
arrive; a deadline or a refusal stops it where the workers last acked."""

from services.launcher.cpu_handover import Handover, Step, handover_steps

OLD = {"decode-0": (0, 1)}
NEW = {"decode-0": (0,), "decode-1": (1,)}


def machine(old=OLD, new=NEW, timeout_s=10.0):
    rounds = handover_steps(old, new)
    return Handover(rounds, old, [timeout_s] * len(rounds))


def test_a_round_begins_only_once_every_step_before_it_is_acked():
    h = machine()
    acks: dict[str, bool | str] = {}
    status = lambda step: acks.get(step.worker)  # noqa: E731
    assert h.advance(0.0, status) == [Step("place", "decode-0", (0,))]
    assert h.advance(1.0, status) == [] and h.awaiting.keys() == {"decode-0"} and h.held == OLD
    assert h.unstarted() == ["decode-1"]  # not begun: a failure now starts it as without a handover
    acks["decode-0"] = True
    assert h.advance(2.0, status) == [Step("start", "decode-1", (1,))]
    assert h.held == {"decode-0": (0,)} and not h.done and h.unstarted() == []
    assert h.advance(3.0, status) == []  # the started worker's first ack is awaited
    acks["decode-1"] = True
    assert h.advance(4.0, status) == [] and h.done and h.over and not h.failed
    assert h.held == NEW


def test_no_cpu_is_held_by_two_workers_at_any_moment_of_a_bigger_handover():
    old = {"prefill-0": (0, 1), "decode-0": (2, 3), "decode-1": (4, 5)}
    new = {"prefill-0": (0,), "prefill-1": (1,), "decode-0": (2,), "decode-2": (3,), "decode-1": (4, 5)}
    h = machine(old, new)
    taken: set[str] = set()
    while not h.over:
        for step in h.advance(0.0, lambda s: True if s.worker in taken else None):
            taken.add(step.worker)
        cpus = [c for held in h.held.values() for c in held]
        assert len(cpus) == len(set(cpus)), h.held
    assert h.done and h.held == new


def test_a_stop_frees_its_cpus_once_the_worker_is_gone():
    old = {"decode-0": (0,), "decode-1": (1,)}
    h = machine(old, {"decode-0": (0, 1)})
    gone: set[str] = set()
    assert h.advance(0.0, lambda s: True if s.worker in gone else None) == [Step("stop", "decode-1")]
    assert h.advance(5.0, lambda s: None) == []
    gone.add("decode-1")
    assert h.advance(6.0, lambda s: True if s.worker in gone else None) == [Step("place", "decode-0", (0, 1))]
    assert h.held == {"decode-0": (0,)}


def test_a_round_past_its_deadline_stops_the_handover_where_the_workers_acked():
    h = machine(timeout_s=10.0)
    h.advance(0.0, lambda s: None)
    assert h.advance(9.9, lambda s: None) == [] and not h.failed
    assert h.advance(10.0, lambda s: None) == []
    assert h.failed == "no answer within 10 s from decode-0 (place)" and h.over and not h.done
    assert h.held == OLD and h.unstarted() == ["decode-1"]  # to start on free CPUs, as without a handover
    assert h.advance(11.0, lambda s: True) == []  # nothing moves any more


def test_a_refused_placement_stops_the_handover():
    h = machine()
    h.advance(0.0, lambda s: None)
    assert h.advance(1.0, lambda s: "CPUs 0 are not available to this worker") == []
    assert h.failed == "decode-0 refused CPUs 0 (place): CPUs 0 are not available to this worker"
    assert h.held == OLD and h.unstarted() == ["decode-1"]


def test_a_step_the_launcher_could_not_take_stops_it_too():
    h = machine()
    h.advance(0.0, lambda s: None)
    [start] = h.advance(1.0, lambda s: True)
    h.refuse(start, "decode-1 would not start")
    assert h.failed == "decode-1 (start): decode-1 would not start" and h.held == {"decode-0": (0,)}
    assert h.unstarted() == []
