"""Model workers get their own CPUs: the policy, the CPU list syntax, and the planned command lines."""

import pytest

from services.common.cpus import parse_cpu_list, share_cpus, worker_cpus
from services.decode.__main__ import build_parser as decode_parser
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
    return topology.UpConfig(model="/m", served_model_name="m", nats_url="nats://127.0.0.1:1", **kw)


def test_disagg_plan_gives_prefill_and_decode_a_cpu_each_and_the_rest_none():
    specs = topology.plan(_config(topology="disagg", cpus=(0, 1)))
    cpus = {s.name: s.args[s.args.index("--cpus") + 1] for s in specs if "--cpus" in s.args}
    assert cpus == {"prefill-0": "0", "decode-0": "1"}
    decode = next(s for s in specs if s.name == "decode-0")
    assert decode_parser().parse_args(list(decode.args)).cpus == (1,)


def test_no_cpus_means_no_binding():
    assert not any("--cpus" in s.args for s in topology.plan(_config(topology="colocated")))
