"""What `splitserve up` starts: each planned service's settings object, rendered to its command line, parses back
with the service's own parser into an equal object, and means what up was asked for."""

import importlib
import sys

import pytest
from launcher_helpers import planned, up_and_run

from services.common.settings import secret_env
from services.launcher.topology import connect_host, http_url
from services.launcher.up_settings import DISAGG_PREFILL_BESIDE_DECODES_MS

CONFIG = dict(topology="colocated", decode=2, host="127.0.0.1", port=8123, namespace="ns1", dtype="float32")


def parsed(spec):
    """The service's own parser's reading of `spec`'s command line (and of the secrets' variables)."""
    module = importlib.import_module(f"services.{spec.role}.__main__")
    return module.settings_of(list(spec.args), environ=secret_env(spec.settings))


def test_colocated_plan():
    specs = planned(**CONFIG)
    assert [(s.name, s.role, s.instance_id) for s in specs] == [
        ("scheduler-0", "scheduler", "scheduler-0"),
        ("decode-0", "decode", "decode-0"),
        ("decode-1", "decode", "decode-1"),
        ("gateway-0", "gateway", "gateway-0"),  # last: it waits for the others anyway
    ]
    gateway = specs[-1]
    assert gateway.argv()[:3] == [sys.executable, "-m", "services.gateway"]
    assert sorted(zip(gateway.args[::2], gateway.args[1::2])) == sorted([
        ("--nats", "nats://127.0.0.1:4999"), ("--namespace", "ns1"), ("--model", "/models/m"),
        ("--served-model-name", "m"), ("--host", "127.0.0.1"), ("--port", "8123"),
        ("--expect", "decode=2,scheduler=1"), ("--instance-id", "gateway-0")])
    assert gateway.url == "http://127.0.0.1:8123"
    assert sorted(zip(specs[1].args[::2], specs[1].args[1::2])) == sorted([
        ("--nats", "nats://127.0.0.1:4999"), ("--namespace", "ns1"), ("--model", "/models/m"),
        ("--served-model-name", "m"), ("--mode", "colocated"), ("--instance-id", "decode-0"), ("--dtype", "float32")])
    assert sorted(specs[0].args) == sorted(("--nats", "nats://127.0.0.1:4999", "--namespace", "ns1", "--instance-id",
                                            "scheduler-0", "--router", "kv"))


def test_the_gateway_gets_the_migration_limit_only_when_one_is_asked_for():
    assert "--migration-limit" not in planned(**CONFIG)[-1].args
    assert parsed(planned(**CONFIG, migration_limit=0)[-1]).migration_limit == 0


def test_the_gateway_gets_the_chat_template_only_when_one_is_given():
    assert "--chat-template" not in planned(**CONFIG)[-1].args
    gateway = planned(**CONFIG, chat_template="/etc/t.jinja")[-1]
    assert parsed(gateway).chat_template == "/etc/t.jinja"


def test_the_api_keys_go_by_their_variable_never_on_the_command_line():
    gateway = planned(**CONFIG, api_keys=("k1", "k2"))[-1]
    assert not any("k1" in arg for arg in gateway.args)
    assert secret_env(gateway.settings) == {"SPLITSERVE_API_KEY": "k1,k2"}
    assert parsed(gateway).api_keys == ("k1", "k2")


def test_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="at least 2 stages"):
        planned(topology="pipeline", stage_ranges=((0, 4),))
    with pytest.raises(ValueError, match="cannot use it"):
        planned(topology="pipeline", stage_ranges=((0, 2), (2, 4)), kv_store=True)


def test_urls_for_wildcard_and_ipv6_hosts():
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("::") == "::1"
    assert http_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert http_url("::1", 8000) == "http://[::1]:8000"


DISAGG = dict(topology="disagg", prefill=2, decode=1, max_local_prefill=0, kv_transport="tcp", namespace="ns1",
              max_num_batched_tokens=512)


def test_disagg_plan():
    specs = planned(**DISAGG)
    # A kv-store by default in disagg, used by every worker.
    assert [s.name for s in specs] == ["scheduler-0", "kvstore-0", "prefill-0", "prefill-1", "decode-0", "gateway-0"]
    scheduler = parsed(specs[0])
    assert scheduler.max_local_prefill == 0 and scheduler.router == "kv"
    assert parsed(specs[2]).kv_transport == "tcp"
    assert all(parsed(s).kv_store for s in specs[2:5])
    assert parsed(specs[4]).mode == "disagg"
    assert all(parsed(s).max_num_batched_tokens == 512 for s in specs[2:5])  # every worker the same step budget
    assert parsed(specs[-1]).expect == {"decode": 1, "scheduler": 1, "kvstore": 1, "prefill": 2}
    without = planned(**{**DISAGG, "kv_store": False, "router": "load"})
    assert [s.name for s in without] == ["scheduler-0", "prefill-0", "prefill-1", "decode-0", "gateway-0"]
    assert not any("--kv-store" in s.args for s in without)
    assert parsed(without[0]).router == "load"
    assert "--no-offload-short-prefills" not in planned(**DISAGG)[0].args
    assert not parsed(planned(**DISAGG, offload_short_prefills=False)[0]).offload_short_prefills
    assert "--prefill-backlog-factor" not in planned(**DISAGG)[0].args  # the scheduler's default
    assert parsed(planned(**DISAGG, prefill_backlog_factor=0.5)[0]).prefill_backlog_factor == 0.5


PIPELINE = dict(topology="pipeline", stage_ranges=((0, 3), (3, 5), (5, 6)), microbatches=3, namespace="ns1")


def test_pipeline_plan():
    specs = planned(**PIPELINE)
    assert [s.name for s in specs] == ["scheduler-0", "stage-1", "stage-2", "stage-0", "gateway-0"]
    layers = {s.name: s.args[s.args.index("--layers") + 1] for s in specs if s.role == "stage"}
    assert layers == {"stage-0": "0:3", "stage-1": "3:5", "stage-2": "5:6"}
    head = parsed(specs[3])
    assert head.stages == ["stage-1", "stage-2"] and head.microbatches == 3
    assert parsed(specs[-1]).expect == {"decode": 1, "scheduler": 1, "stage": 2}


def test_several_pipelines_each_start_their_stages_before_their_head():
    from services.launcher.topology import pool_of, stages_of

    specs = planned(**{**PIPELINE, "decode": 2})
    assert [s.name for s in specs] == ["scheduler-0", "stage-1", "stage-2", "stage-0", "stage-1-p1", "stage-2-p1",
                                       "stage-0-p1", "gateway-0"]
    assert stages_of(specs[6]) == ("stage-1-p1", "stage-2-p1") and stages_of(specs[4]) == ()
    assert [pool_of(s) for s in specs[4:7]] == ["stage", "stage", "decode"]  # the head takes the decode pool's work
    layers = {s.name: s.args[s.args.index("--layers") + 1] for s in specs if s.role == "stage"}
    assert layers["stage-0-p1"] == "0:3" and layers["stage-2-p1"] == "5:6"
    assert parsed(specs[-1]).expect == {"decode": 2, "scheduler": 1, "stage": 4}


PREFILL_PIPELINE = dict(topology="disagg", prefill=1, stage_ranges=((0, 2), (2, 4)), kv_transport="shm",
                        namespace="ns1", kv_store=False)


def test_disagg_with_a_prefill_pipeline_plan():
    specs = planned(**PREFILL_PIPELINE)
    assert [s.name for s in specs] == ["scheduler-0", "prefill-stage-1", "prefill-0", "decode-0", "gateway-0"]
    stage, head = parsed(specs[1]), parsed(specs[2])
    assert stage.ships_kv and stage.kv_transport == "shm"
    assert head.head_role == "prefill" and head.stages == ["prefill-stage-1"]
    assert specs[2].role == "stage" and parsed(specs[3]).mode == "disagg"
    assert parsed(specs[-1]).expect == {"decode": 1, "scheduler": 1, "prefill": 1, "stage": 1}
    with pytest.raises(ValueError, match="--prefill must be 1"):
        planned(topology="disagg", prefill=2, stage_ranges=((0, 2), (2, 4)))


def test_the_planned_pipelines_are_what_each_stage_may_send_along():
    from services.launcher.topology import pipelines_of
    from shared.bus.permissions import Pipeline

    assert pipelines_of(planned(**PIPELINE)) == (Pipeline("stage-0", ("stage-1", "stage-2")),)
    assert pipelines_of(planned(**PIPELINE, decode=2))[1] == Pipeline("stage-0-p1", ("stage-1-p1", "stage-2-p1"))
    assert pipelines_of(planned(**PREFILL_PIPELINE)) == (Pipeline("prefill-0", ("prefill-stage-1",)),)
    assert pipelines_of(planned(**DISAGG)) == ()


WITH_KV_STORE = dict(topology="colocated", decode=2, kv_store=True, kv_store_ram_bytes=1 << 20,
                     kv_store_disk_bytes=1 << 24, kv_store_dir="/tmp/kv", namespace="ns1")


def test_a_kv_store_plan():
    specs = planned(**WITH_KV_STORE)
    assert [s.name for s in specs] == ["scheduler-0", "kvstore-0", "decode-0", "decode-1", "gateway-0"]
    assert parsed(specs[1]).kv_store_dir == "/tmp/kv" and parsed(specs[2]).kv_store
    assert parsed(specs[-1]).expect == {"decode": 2, "scheduler": 1, "kvstore": 1}
    assert "--kv-store" not in planned(**CONFIG)[1].args


SECURED = {**DISAGG, "prefill": 1, "cpus": (4, 5), "nats_tls_ca": "/etc/nats-ca.pem", "api_keys": ("k",),
           "transfer_tls": ("/t/ca.pem", "/t/cert.pem", "/t/key.pem"), "cpu_loan_dir": "/run/loans",
           "nats_replicas": 3, "drain_timeout": 6.5, "device": "cuda", "decode_device": "cpu"}

# Each config, the services it must plan, and what the gateway waits for.
PLANNED = {
    "colocated": (CONFIG, ("scheduler-0", "decode-0", "decode-1", "gateway-0"), {"decode": 2, "scheduler": 1}),
    "disagg": (DISAGG, ("scheduler-0", "kvstore-0", "prefill-0", "prefill-1", "decode-0", "gateway-0"),
               {"decode": 1, "scheduler": 1, "kvstore": 1, "prefill": 2}),
    "pipeline": (PIPELINE, ("scheduler-0", "stage-1", "stage-2", "stage-0", "gateway-0"),
                 {"decode": 1, "scheduler": 1, "stage": 2}),
    "prefill-pipeline": (PREFILL_PIPELINE, ("scheduler-0", "prefill-stage-1", "prefill-0", "decode-0", "gateway-0"),
                         {"decode": 1, "scheduler": 1, "prefill": 1, "stage": 1}),
    "kv-store": (WITH_KV_STORE, ("scheduler-0", "kvstore-0", "decode-0", "decode-1", "gateway-0"),
                 {"decode": 2, "scheduler": 1, "kvstore": 1}),
    "credentials": ({**PREFILL_PIPELINE, "nats_creds_dir": "/run/creds"},
                    ("scheduler-0", "prefill-stage-1", "prefill-0", "decode-0", "gateway-0"),
                    {"decode": 1, "scheduler": 1, "prefill": 1, "stage": 1}),
    "secured": (SECURED, ("scheduler-0", "kvstore-0", "prefill-0", "decode-0", "gateway-0"),
                {"decode": 1, "scheduler": 1, "kvstore": 1, "prefill": 1}),
}
# SECURED: one CPU each, so prefill-0 lends its CPU to decode-0 while idle.
SECURED_CPUS = {"prefill-0": (4,), "decode-0": (5,)}


def _role(config: dict, name: str) -> str:
    """A prefill pipeline's stages, its head (prefill-0) included, run as stages."""
    if name.startswith("prefill-stage-") or (name == "prefill-0" and config.get("stage_ranges")):
        return "stage"
    return name.rsplit("-", 1)[0]


def test_each_config_plans_exactly_its_services():
    for config, names, _ in PLANNED.values():
        assert [(s.name, s.role) for s in planned(**config)] == [(n, _role(config, n)) for n in names]


def _bus(up, run, name: str) -> dict:
    return {"nats": run.nats_url, "namespace": up.namespace, "instance_id": name,
            "nats_creds": f"{run.nats_creds_dir}/{name}.nk" if run.nats_creds_dir else None,
            "nats_tls_ca": run.nats_tls_ca, "nats_replicas": run.nats_replicas}


def _scheduler_meaning(up, settings) -> dict:
    disagg = up.topology == "disagg"
    local = up.max_local_prefill if disagg else None
    backlog = up.prefill_backlog_factor if disagg else None
    return {"router": up.router,
            "max_local_prefill": settings.model_fields["max_local_prefill"].default if local is None else local,
            "offload_short_prefills": up.offload_short_prefills or not disagg,
            "prefill_backlog_factor": settings.model_fields["prefill_backlog_factor"].default
            if backlog is None else backlog}


def _meaning(config: dict, names: tuple[str, ...], name: str, expect: dict[str, int], settings) -> dict:
    """What service `name` must have been told, worked out from the config alone."""
    up, run = up_and_run(**config)
    role = _role(config, name)
    disagg = up.topology == "disagg"
    kv_store = up.kv_store if up.kv_store is not None else disagg
    told = _bus(up, run, name)
    tls = dict(zip(("transfer_tls_ca", "transfer_tls_cert", "transfer_tls_key"), run.transfer_tls or (None,) * 3))
    model = {"model": run.model_dir, "served_model_name": run.served_model_name}
    if role == "scheduler":
        return told | _scheduler_meaning(up, settings)
    if role == "gateway":
        drain = settings.model_fields["drain_timeout"].default if run.drain_timeout is None else run.drain_timeout
        return told | model | {"host": up.host, "port": up.port, "expect": expect, "api_keys": up.api_keys,
                               "drain_timeout": drain}
    if role == "kvstore":
        return told | tls | {"kv_store_ram_bytes": up.kv_store_ram_bytes,
                             "kv_store_disk_bytes": up.kv_store_disk_bytes, "kv_store_dir": run.kv_store_dir}
    told |= tls | model | {"dtype": up.dtype, "cpus": SECURED_CPUS.get(name) if config is SECURED else None,
                           "max_num_batched_tokens": up.max_num_batched_tokens
                           or settings.model_fields["max_num_batched_tokens"].default,
                           "device": (up.prefill_device if role == "prefill" else up.decode_device) or up.device}
    loan = f"{run.cpu_loan_dir}/prefill-0.loan" if run.cpu_loan_dir else None
    if role == "decode":
        paced = up.prefill_beside_decodes_ms
        paced = (DISAGG_PREFILL_BESIDE_DECODES_MS if disagg else None) if paced is None else paced or None
        return told | {"mode": "disagg" if disagg else "colocated", "kv_store": kv_store,
                       "prefill_beside_decodes_ms": paced, "cpu_loan": loan,
                       "borrow_cpus": SECURED_CPUS["prefill-0"] if loan else None}
    if role == "prefill":
        return told | {"kv_transport": up.kv_transport, "kv_store": kv_store, "cpu_loan": loan,
                       "prefill_beside_decodes_ms": None}
    head = name in ("stage-0", "prefill-0")
    index = 0 if head else int(name.rsplit("-", 1)[1])
    later = [n for n in names if _role(config, n) == "stage" and n not in ("stage-0", "prefill-0")]
    return told | {"layers": run.stage_ranges[index], "stages": later if head else None,
                   "microbatches": up.microbatches if head else settings.model_fields["microbatches"].default,
                   "head_role": "prefill" if head and disagg else "decode",
                   "ships_kv": disagg and not head,  # a prefill pool's stages ship their layers' KV
                   "kv_transport": up.kv_transport if disagg else "auto"}


PLANNED_SERVICES = [(c, n) for c, (_, names, _) in PLANNED.items() for n in names]


@pytest.mark.parametrize(("config_id", "name"), PLANNED_SERVICES)
def test_every_planned_command_line_parses_to_what_the_config_asked(config_id, name):
    config, names, expect = PLANNED[config_id]
    spec = {s.name: s for s in planned(**config)}[name]
    settings = parsed(spec)
    told = dict(settings)
    if "layers" in told:
        told["layers"] = (told["layers"].start, told["layers"].end)
    meaning = _meaning(config, names, name, expect, type(settings))
    assert {k: told[k] for k in meaning} == meaning


@pytest.mark.parametrize(("config_id", "name"), PLANNED_SERVICES)
def test_every_planned_settings_object_parses_back_equal(config_id, name):
    """The round trip: `plan`'s settings object, rendered by `to_flags`, read by the service's own parser."""
    spec = {s.name: s for s in planned(**PLANNED[config_id][0])}[name]
    assert parsed(spec) == spec.settings
    assert type(parsed(spec)).ROLE == spec.role


def test_decode_workers_pace_prompt_chunks_in_disagg_by_default_and_as_told_elsewhere():
    def pacing(config) -> dict[str, float | None]:
        return {s.name: parsed(s).prefill_beside_decodes_ms for s in planned(**config)
                if s.role in ("decode", "prefill")}

    assert pacing(DISAGG) == {"prefill-0": None, "prefill-1": None,  # prefill has no decodes
                              "decode-0": DISAGG_PREFILL_BESIDE_DECODES_MS}
    assert pacing({**DISAGG, "prefill_beside_decodes_ms": 0.0})["decode-0"] is None
    colocated = {**DISAGG, "topology": "colocated", "decode": 2}
    assert pacing(colocated) == {"decode-0": None, "decode-1": None}  # the baseline as vLLM runs it
    assert pacing({**colocated, "prefill_beside_decodes_ms": 40.0}) == {"decode-0": 40.0, "decode-1": 40.0}
