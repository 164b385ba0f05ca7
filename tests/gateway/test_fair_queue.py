"""The fair queue's policy: tags, priorities, and a quiet tenant ahead of a noisy one's backlog."""

import pytest

from services.gateway import token_bucket as tb
from services.gateway.fair_queue import FairQueue, Tag, first, tag


@pytest.mark.parametrize("vtime, finish, cost, tagged", [
    (0, 0, 10, (0, 10)),
    (5, 30, 10, (30, 40)),  # behind its own backlog
    (50, 30, 10, (50, 60)),  # idle: no banked credit
    (0, 0, 0, (0, 1)),  # every request costs something
])
def test_tags(vtime, finish, cost, tagged):
    assert tag(vtime, finish, cost) == tagged


def test_first_takes_priority_then_start_then_arrival():
    assert first({}) is None
    assert first({"a": Tag(0, 5, 1), "b": Tag(0, 3, 2)}) == "b"
    assert first({"a": Tag(-1, 9, 3), "b": Tag(0, 3, 2)}) == "a"  # priority 1 first
    assert first({"a": Tag(0, 3, 1), "b": Tag(0, 3, 2)}) == "a"


def drain(queue: FairQueue) -> list:
    out = []
    while (popped := queue.pop()) is not None:
        out.append(popped[1])
    return out


def test_a_quiet_tenants_request_goes_ahead_of_a_noisy_backlog():
    queue = FairQueue()
    for i in range(8):
        queue.push("noisy", f"n{i}", cost=10)
    assert drain(queue)[:2] == ["n0", "n1"]
    for i in range(8):
        queue.push("noisy", f"n{i}", cost=10)
    queue.pop()
    queue.push("quiet", "q0", cost=10)
    assert drain(queue)[:2] == ["q0", "n1"]


def test_equal_tenants_alternate_and_costs_weigh():
    queue = FairQueue()
    for i in range(3):
        queue.push("a", f"a{i}", cost=10)
        queue.push("b", f"b{i}", cost=10)
        queue.push("big", f"big{i}", cost=30)
    assert drain(queue) == ["a0", "b0", "big0", "a1", "b1", "a2", "b2", "big1", "big2"]


def test_priority_is_strict_and_removal_leaves_the_rest():
    queue = FairQueue()
    queue.push("low", "l0", cost=1)
    queue.push("high", "h0", cost=1, priority=2)
    queue.push("high", "h1", cost=1, priority=2)
    assert queue.remove("high", "h1") and not queue.remove("high", "h1") and len(queue) == 2
    assert drain(queue) == ["h0", "l0"]


def test_token_bucket_admits_debits_and_says_when():
    bucket = tb.full(600, now=0.0)  # 10 tokens a second
    bucket, wait = tb.admit(bucket, 500, 0.0)
    assert wait is None and bucket.level == 100
    bucket, wait = tb.admit(bucket, 200, 0.0)
    assert wait == pytest.approx(10.0) and bucket.level == 100  # refused: nothing taken
    bucket = tb.charge(bucket, 300, 1.0)  # a completion's tokens: into debt
    assert bucket.level == pytest.approx(-190)
    bucket, wait = tb.admit(bucket, 10, 1.0)
    assert wait == pytest.approx(20.0)
    assert tb.admit(bucket, 10, 21.0)[1] is None
    # a prompt larger than the bucket goes once it is full, never waits forever
    assert tb.admit(tb.full(600, 0.0), 5000, 0.0)[1] is None
    assert tb.refilled(tb.Bucket(600, 0, 0.0), 1000.0).level == 600
