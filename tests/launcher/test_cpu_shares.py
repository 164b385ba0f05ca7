"""Model workers get their own CPUs: the policy, the CPU list syntax, and the planned command lines."""

import pytest
from launcher_helpers import up_and_run

from services.common.cpus import pair_cpu_loans, parse_cpu_list, share_cpus, worker_cpus
from services.decode.__main__ import settings_of as decode_settings
from services.launcher import topology


def test_cpu_lists_parse_ranges_and_singles():
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpu_list("5,1,1") == (1, 5)
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_shares_are_disjoint_contiguous_and_even():
    assert share_cpus(["prefill-0", "decode-0"], (0, 1)) == {"prefill-0": (0,), "decode-0": (1,)}
    assert share_cpus(["a", "b", "c"], tuple(range(8))) == {"a": (0, 1, 2), "b": (3, 4, 5), "c": (6, 7)}
    assert share_cpus(["decode-0"], (0, 1)) == {"decode-0": (0, 1)}


def test_more_workers_than_cpus_take_one_cpu_each_in_turn():
    assert share_cpus(["a", "b", "c"], (4, 5)) == {"a": (4,), "b": (5,), "c": (4,)}
    assert share_cpus([], (0,)) == {} and share_cpus(["a"], ()) == {}


def test_up_cpus_must_be_usable():
    assert worker_cpus("none") == ()
    assert set(worker_cpus("auto")) >= {min(worker_cpus("auto"))}
    with pytest.raises(ValueError, match="not available"):
        worker_cpus("100000")


def _config(**kw):
    return up_and_run(model_dir="/m", nats_url="nats://127.0.0.1:1", **kw)


def test_disagg_plan_gives_prefill_and_decode_a_cpu_each_and_the_rest_none():
    specs = topology.plan(*_config(topology="disagg", cpus=(0, 1)))
    cpus = {s.name: s.args[s.args.index("--cpus") + 1] for s in specs if "--cpus" in s.args}
    assert cpus == {"prefill-0": "0", "decode-0": "1"}
    decode = next(s for s in specs if s.name == "decode-0")
    assert decode_settings(list(decode.args), environ={}).cpus == (1,)


def test_no_cpus_means_no_binding():
    assert not any("--cpus" in s.args for s in topology.plan(*_config(topology="colocated")))


def test_cpu_loans_pair_each_prefill_worker_with_a_decode_worker_of_its_own_cpus():
    shares = {"prefill-0": (0,), "prefill-1": (1,), "decode-0": (2,), "decode-1": (3, 4), "decode-2": (5,)}
    # prefill-1's decode worker has two CPUs: only one-and-one loans are run (services/common/cpu_loan.py).
    assert pair_cpu_loans(["prefill-0", "prefill-1"], ["decode-0", "decode-1", "decode-2"], shares) == [
        ("prefill-0", "decode-0")]
    # A CPU already shared by two workers has nothing to lend; no binding, nothing to pair.
    assert pair_cpu_loans(["prefill-0"], ["decode-0", "decode-1"],
                          {"prefill-0": (0,), "decode-0": (1,), "decode-1": (0,)}) == []
    assert pair_cpu_loans(["prefill-0"], ["decode-0"], {}) == []


def test_disagg_plan_lends_the_prefill_workers_cpu_to_its_decode_worker(tmp_path):
    from services.prefill.__main__ import settings_of as prefill_settings

    specs = {s.name: s for s in topology.plan(*_config(topology="disagg", cpus=(0, 1), cpu_loan_dir=str(tmp_path)))}
    decode = decode_settings(list(specs["decode-0"].args), environ={})
    prefill = prefill_settings(list(specs["prefill-0"].args), environ={})
    assert decode.cpus == (1,) and decode.borrow_cpus == (0,)
    assert decode.cpu_loan == prefill.cpu_loan == str(tmp_path / "prefill-0.loan")
    # Without a loan directory, colocated, or CPUs left to the OS: no loans.
    for config in (_config(topology="disagg", cpus=(0, 1)), _config(topology="colocated", cpus=(0, 1), cpu_loan_dir="d"),
                   _config(topology="disagg", cpu_loan_dir="d")):
        assert not any("--cpu-loan" in s.args for s in topology.plan(*config))


def test_a_decode_worker_borrows_one_cpu_beside_one_of_its_own():
    from services.common.cpu_loan import check_borrowing

    check_borrowing((1,), (0,), "loan")
    for own, lent, loan in (((1,), None, "loan"), (None, (0,), "loan"), ((1,), (0,), None), ((0,), (0,), "loan"),
                            ((1, 2), (0,), "loan"), ((2,), (0, 1), "loan")):
        with pytest.raises(ValueError):
            check_borrowing(own, lent, loan)


def test_each_pinned_decode_and_prefill_worker_follows_a_placement_file_of_its_own():
    specs = topology.plan(*_config(topology="disagg", cpus=(0, 1), cpu_placement_dir="/run/cpus"))
    files = {s.name: s.settings.cpus_file for s in specs if getattr(s.settings, "cpus_file", None)}
    assert files == {"prefill-0": "/run/cpus/prefill-0.cpus", "decode-0": "/run/cpus/decode-0.cpus"}
    decode = next(s for s in specs if s.name == "decode-0")
    assert decode_settings(list(decode.args), environ={}).cpus_file == "/run/cpus/decode-0.cpus"
    # Unpinned workers have nothing to follow; without the directory, nothing is followed.
    for config in (_config(topology="colocated", cpu_placement_dir="/run/cpus"),
                   _config(topology="colocated", cpus=(0, 1))):
        assert not any("--cpus-file" in s.args for s in topology.plan(*config))
