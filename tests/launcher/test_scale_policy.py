"""`splitserve scale`'s policy, pure: what may scale, what a scale starts and retires, where new workers run, and
what the gateway and `ps` make of the desired sizes."""

import pytest

from services.cli.ps import pools, pools_line
from services.gateway.readiness import expected
from services.launcher.deployment import Deployment, write_deployment
from services.launcher.placement import place_new_workers
from services.launcher.resolved_run import ResolvedRun
from services.launcher.scale_policy import (
    ScaleError,
    check_scale,
    desired_pools,
    parse_counts,
    pool_sizes,
    reconcile,
    sized,
)
from services.launcher.served_models import check_topology
from services.launcher.topology import plan
from services.launcher.up_settings import UpSettings


def test_counts_are_role_equals_n():
    assert parse_counts(["decode=2", "prefill=1"]) == {"decode": 2, "prefill": 1}
    for bad in (["decode"], ["decode=x"], ["=2"], ["decode=2", "decode=3"], []):
        with pytest.raises(ScaleError):
            parse_counts(bad)


@pytest.mark.parametrize("counts, topology, pipelined, said", [
    ({"stage": 2}, "disagg", False, "do not scale on their own"),
    ({"stage-head": 2}, "pipeline", False, r"decode=N runs N"),
    ({"kv-store": 2}, "disagg", False, "unknown role"),
    ({"kvstore": 2}, "colocated", False, "runs no kv-store"),
    ({"kvstore": 0}, "disagg", False, "at least 1"),
    ({"gateway": 2}, "disagg", False, "a deployment runs one"),
    ({"decoder": 2}, "disagg", False, "unknown role"),
    ({"decode": 0}, "disagg", False, "at least 1"),
    ({"decode": "2"}, "disagg", False, "at least 1"),
    ({"prefill": 2}, "colocated", False, "has no prefill pool"),
    ({"prefill": 2}, "disagg", True, "one pipeline"),
    ({"prefill": 2}, "pipeline", False, "has no prefill pool"),
])
def test_what_does_not_scale_is_refused_with_its_reason(counts, topology, pipelined, said):
    with pytest.raises(ScaleError, match=said):
        check_scale(counts, topology, pipelined)


def test_decode_prefill_and_kv_store_pools_scale():
    assert check_scale({"decode": 3, "prefill": 2}, "disagg", False) == {"decode": 3, "prefill": 2}
    assert check_scale({"decode": 3}, "colocated", False) == {"decode": 3}
    assert check_scale({"kvstore": 3}, "colocated", False, kv_store=True) == {"kvstore": 3}
    assert check_scale({"decode": 2}, "pipeline", False) == {"decode": 2}  # two pipelines


def test_a_pipeline_deployments_pool_is_its_pipelines():
    up = UpSettings(topology="pipeline", decode=2, stages=2)
    assert desired_pools(up) == {"decode": 2}
    specs = plan(sized(up, {"decode": 3}), ResolvedRun(model_dir="m", served_model_name="m", nats_url="nats://x",
                                                      cpus=(), drain_timeout=None, stage_ranges=((0, 2), (2, 4))))
    heads = [s for s in specs if s.role == "stage" and s.settings.stages]
    assert [(h.name, h.settings.stages) for h in heads] == [("stage-0", ["stage-1"]), ("stage-0-p1", ["stage-1-p1"]),
                                                            ("stage-0-p2", ["stage-1-p2"])]


def test_a_scale_sizes_ups_settings_pool_by_pool():
    up = sized(UpSettings(topology="disagg"), {"decode": 3, "prefill": 2, "kvstore": 4})
    assert (up.decode, up.prefill, up.kv_stores) == (3, 2, 4)
    assert [s.name for s in plan(up, ResolvedRun(model_dir="m", served_model_name="m", nats_url="nats://x", cpus=(), drain_timeout=None))
            if s.role == "kvstore"] == ["kvstore-0", "kvstore-1", "kvstore-2", "kvstore-3"]


def test_kv_stores_need_a_kv_store():
    with pytest.raises(ValueError, match="add --kv-store"):
        check_topology(UpSettings(topology="colocated", kv_stores=2))
    check_topology(UpSettings(topology="colocated", kv_store=True, kv_stores=2))


def test_reconcile_starts_the_missing_and_retires_the_unplanned():
    assert reconcile(["decode-0", "decode-1"], ["decode-0"], []) == (["decode-1"], [])
    assert reconcile(["decode-0"], ["decode-0", "decode-1"], []) == ([], ["decode-1"])
    # A name still draining is started again only once it is gone.
    assert reconcile(["decode-0", "decode-1"], ["decode-0"], ["decode-1"]) == ([], [])
    assert pool_sizes({"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill", "gateway-0": "gateway"},
                      ["decode-1"]) == {"decode": 1, "prefill": 1}


def test_desired_pools_follow_the_topology():
    assert desired_pools(UpSettings(decode=2, prefill=3)) == {"decode": 2, "prefill": 3, "kvstore": 1}
    assert desired_pools(UpSettings(decode=2, prefill=3, kv_store=False)) == {"decode": 2, "prefill": 3}
    assert desired_pools(UpSettings(topology="colocated", decode=2)) == {"decode": 2}
    assert desired_pools(UpSettings(topology="colocated", kv_store=True, kv_stores=2)) == {"decode": 1, "kvstore": 2}
    assert desired_pools(UpSettings(prefill_stages=2, kv_store=False)) == {"decode": 1}
    assert desired_pools(UpSettings(topology="pipeline")) == {"decode": 1}  # its pipelines


def test_new_workers_get_free_cpus_and_share_only_when_none_are_left():
    taken = {"prefill-0": (0,), "decode-0": (1, 2)}
    assert place_new_workers(taken, ["decode-1"], (0, 1, 2, 3, 4, 5)) == {"decode-1": (3, 4, 5)}
    assert place_new_workers(taken, ["decode-1", "decode-2"], (0, 1, 2, 3, 4, 5)) == {"decode-1": (3, 4),
                                                                                     "decode-2": (5,)}
    # 2 CPUs, both taken: the least shared, one each.
    placed = place_new_workers({"prefill-0": (0,), "decode-0": (1,)}, ["decode-1", "decode-2"], (0, 1))
    assert placed == {"decode-1": (0,), "decode-2": (1,)}
    assert place_new_workers(taken, ["decode-1"], ()) == {}


def test_the_gateway_judges_by_the_launchers_desired_sizes(tmp_path):
    assert expected({"decode": 2, "scheduler": 1}, None) == {"decode": 2, "scheduler": 1}
    write_deployment(tmp_path, Deployment(run_dir=str(tmp_path), namespace="n", topology="disagg",
                                          desired={"decode": 1, "prefill": 3}))
    assert expected({"decode": 2, "scheduler": 1}, str(tmp_path)) == {"decode": 1, "scheduler": 1}


def test_ps_counts_running_and_retiring_workers_per_pool():
    services = [{"role": "decode", "state": "running", "recorded_state": "running"},
                {"role": "decode", "state": "running", "recorded_state": "stopping"},
                {"role": "prefill", "state": "exited", "recorded_state": "running"},
                {"role": "gateway", "state": "running", "recorded_state": "running"}]
    counted = pools({"decode": 1, "prefill": 1}, services)
    assert counted == {"decode": {"desired": 1, "running": 1, "retiring": 1},
                       "prefill": {"desired": 1, "running": 0, "retiring": 0}}
    assert pools_line(counted) == "pools (running/desired): decode 1/1 (1 retiring), prefill 0/1"
    assert pools_line({}) is None
