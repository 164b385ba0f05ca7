"""The placement file a worker follows at runtime, its ack, and which placements a worker refuses."""

import pytest

from services.common.cpu_follow import placement_problem
from services.common.cpu_placement import (
    Ack, Placement, ack_path, format_ack, format_placement, parse_ack, parse_placement, placement_acked, read_ack,
    write_ack, write_placement,
)


@pytest.mark.parametrize("placement", [Placement(0, (0,)), Placement(7, (0, 1, 2, 5)), Placement(3, (1,), (0,))])
def test_a_placement_reads_back_as_written(placement):
    assert parse_placement(format_placement(placement)) == placement


def test_the_file_says_cpus_as_lists():
    assert format_placement(Placement(4, (2, 3), ())) == '{"generation": 4, "cpus": "2,3", "borrow_cpus": ""}'
    assert parse_placement('{"generation": 4, "cpus": "2-3"}') == Placement(4, (2, 3), ())


BAD = {
    "not JSON": ("{", "not JSON"),
    "not an object": ("[1]", "not a JSON object"),
    "no generation": ('{"cpus": "0"}', "generation must be"),
    "a negative generation": ('{"generation": -1, "cpus": "0"}', "generation must be"),
    "a true generation": ('{"generation": true, "cpus": "0"}', "generation must be"),
    "no CPUs": ('{"generation": 1, "cpus": ""}', "names no CPU"),
    "CPUs as numbers": ('{"generation": 1, "cpus": 0}', "must be a CPU list in a string"),
    "a bad list": ('{"generation": 1, "cpus": "3-1"}', "counts down"),
    "an unknown field": ('{"generation": 1, "cpus": "0", "cores": "1"}', "unknown fields cores"),
    "borrowing its own": ('{"generation": 1, "cpus": "0", "borrow_cpus": "0"}', "must not overlap"),
}


@pytest.mark.parametrize("text, error", BAD.values(), ids=BAD.keys())
def test_a_bad_file_says_what_is_wrong(text, error):
    with pytest.raises(ValueError, match=error):
        parse_placement(text)


def test_the_ack_says_what_was_applied_or_why_not(tmp_path):
    path = tmp_path / "decode-0.cpus"
    assert read_ack(path) is None
    write_placement(path, Placement(2, (0, 1)))
    write_ack(path, Ack(2, True), Placement(2, (0, 1)))
    assert read_ack(path) == Ack(2, True)
    assert ack_path(path).read_text() == '{"generation": 2, "applied": true, "cpus": "0,1", "borrow_cpus": ""}'
    assert placement_acked(path, 2) is True and placement_acked(path, 3) is None  # (3: not answered yet)
    write_ack(path, Ack(3, False, "no"))
    assert read_ack(path) == Ack(3, False, "no") and placement_acked(path, 3) is False
    assert {oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()} == {"0o600"}
    assert parse_ack(format_ack(Ack(None, False, "not a placement"))) == Ack(None, False, "not a placement")


PROBLEMS = {
    "within its CPUs": (Placement(1, (2, 3)), False, ""),
    "a CPU it may not use": (Placement(1, (3, 4)), False, "CPUs 4 are not available to this worker (it may use 0,1,2,3)"),
    "a lent CPU it may not use": (Placement(1, (1,), (9,)), True, "CPUs 9 are not available"),
    "a loan without a borrower": (Placement(1, (1,), (2,)), False, "this worker borrows no CPUs"),
    "a loan it cannot run": (Placement(1, (0, 1), (2,)), True, "borrows one CPU beside one of its own"),
    "a loan followed": (Placement(1, (1,), (2,)), True, ""),
    "a loan ended": (Placement(1, (0, 1)), True, ""),
}


@pytest.mark.parametrize("placement, borrower, problem", PROBLEMS.values(), ids=PROBLEMS.keys())
def test_what_a_worker_refuses(placement, borrower, problem):
    found = placement_problem(placement, (0, 1, 2, 3), borrower)
    assert (problem in found) if problem else found == ""
