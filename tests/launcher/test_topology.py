"""What `splitserve up` starts, and that every planned command line parses with the service's own parser."""

import dataclasses
import importlib
import sys

import pytest

from services.launcher.topology import DISAGG_PREFILL_BESIDE_DECODES_MS, UpConfig, connect_host, http_url, plan

CONFIG = UpConfig(model="/models/m", served_model_name="m", nats_url="nats://127.0.0.1:4999", decode=2,
                  host="127.0.0.1", port=8123, namespace="ns1", dtype="float32")


def test_colocated_plan():
    specs = plan(CONFIG)
    assert [(s.name, s.role, s.instance_id) for s in specs] == [
        ("scheduler-0", "scheduler", "scheduler-0"),
        ("decode-0", "decode", "decode-0"),
        ("decode-1", "decode", "decode-1"),
        ("gateway-0", "gateway", "gateway-0"),  # last: it waits for the others anyway
    ]
    gateway = specs[-1]
    assert gateway.argv()[:3] == [sys.executable, "-m", "services.gateway"]
    assert gateway.args == (
        "--nats", "nats://127.0.0.1:4999", "--namespace", "ns1", "--model", "/models/m", "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", "8123", "--expect", "decode=2,scheduler=1", "--instance-id", "gateway-0",
    )
    assert gateway.url == "http://127.0.0.1:8123"
    assert specs[1].args == (
        "--nats", "nats://127.0.0.1:4999", "--namespace", "ns1", "--model", "/models/m", "--served-model-name", "m",
        "--mode", "colocated", "--instance-id", "decode-0", "--dtype", "float32",
    )
    assert specs[0].args == ("--nats", "nats://127.0.0.1:4999", "--namespace", "ns1", "--instance-id", "scheduler-0",
                             "--router", "kv")


def test_the_gateway_gets_the_migration_limit_only_when_one_is_asked_for():
    assert "--migration-limit" not in plan(CONFIG)[-1].args
    assert plan(dataclasses.replace(CONFIG, migration_limit=0))[-1].args[-2:] == ("--migration-limit", "0")


def test_the_gateway_gets_the_chat_template_only_when_one_is_given():
    assert "--chat-template" not in plan(CONFIG)[-1].args
    gateway = plan(dataclasses.replace(CONFIG, chat_template="/etc/t.jinja"))[-1]
    assert gateway.args[-2:] == ("--chat-template", "/etc/t.jinja")
    parsed = importlib.import_module("services.gateway.__main__").settings_of(list(gateway.args), environ={})
    assert parsed.chat_template == "/etc/t.jinja"


def test_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown topology 'ring'"):
        plan(UpConfig(model="m", served_model_name="m", nats_url="n", topology="ring"))
    with pytest.raises(ValueError, match="at least 2 stages"):
        plan(UpConfig(model="m", served_model_name="m", nats_url="n", topology="pipeline", stage_ranges=((0, 4),)))
    with pytest.raises(ValueError, match="at least 1"):
        plan(UpConfig(model="m", served_model_name="m", nats_url="n", decode=0))
    with pytest.raises(ValueError, match="cannot use it"):
        plan(UpConfig(model="m", served_model_name="m", nats_url="n", topology="pipeline", stage_ranges=((0, 2), (2, 4)),
                      kv_store=True))


def test_urls_for_wildcard_and_ipv6_hosts():
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("::") == "::1"
    assert http_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert http_url("::1", 8000) == "http://[::1]:8000"


DISAGG = UpConfig(model="/models/m", served_model_name="m", nats_url="nats://127.0.0.1:4999", topology="disagg",
                  prefill=2, decode=1, max_local_prefill=0, kv_transport="tcp", namespace="ns1",
                  max_num_batched_tokens=512)


def test_disagg_plan():
    specs = plan(DISAGG)
    # A kv-store by default in disagg, used by every worker.
    assert [s.name for s in specs] == ["scheduler-0", "kvstore-0", "prefill-0", "prefill-1", "decode-0", "gateway-0"]
    assert specs[0].args[-2:] == ("--max-local-prefill", "0")
    assert specs[0].args[specs[0].args.index("--router") + 1] == "kv"
    assert ("--kv-transport", "tcp", "--kv-store") == specs[2].args[-3:]
    assert all("--kv-store" in s.args for s in specs[2:5])
    specs = specs[1:]
    decode_args = specs[3].args
    assert decode_args[decode_args.index("--mode") + 1] == "disagg"
    for worker in specs[1:4]:  # every worker gets the same step budget
        assert worker.args[worker.args.index("--max-num-batched-tokens") + 1] == "512"
    gateway_args = specs[-1].args
    assert gateway_args[gateway_args.index("--expect") + 1] == "decode=1,scheduler=1,kvstore=1,prefill=2"
    without = plan(dataclasses.replace(DISAGG, kv_store=False, router="load"))
    assert [s.name for s in without] == ["scheduler-0", "prefill-0", "prefill-1", "decode-0", "gateway-0"]
    assert not any("--kv-store" in s.args for s in without)
    assert without[0].args[without[0].args.index("--router") + 1] == "load"
    assert "--no-offload-short-prefills" not in plan(DISAGG)[0].args
    kept_local = plan(dataclasses.replace(DISAGG, offload_short_prefills=False))
    assert kept_local[0].args[-1] == "--no-offload-short-prefills"
    assert "--prefill-backlog-factor" not in plan(DISAGG)[0].args  # the scheduler's default
    backlog_off = plan(dataclasses.replace(DISAGG, prefill_backlog_factor=0.0))
    assert backlog_off[0].args[-2:] == ("--prefill-backlog-factor", "0")


PIPELINE = UpConfig(model="/models/m", served_model_name="m", nats_url="nats://127.0.0.1:4999", topology="pipeline",
                    stage_ranges=((0, 3), (3, 5), (5, 6)), microbatches=3, namespace="ns1")


def test_pipeline_plan():
    specs = plan(PIPELINE)
    assert [s.name for s in specs] == ["scheduler-0", "stage-1", "stage-2", "stage-0", "gateway-0"]
    layers = {s.name: s.args[s.args.index("--layers") + 1] for s in specs if s.role == "stage"}
    assert layers == {"stage-0": "0:3", "stage-1": "3:5", "stage-2": "5:6"}
    head = specs[3].args
    assert head[head.index("--stages") + 1] == "stage-1,stage-2" and head[head.index("--microbatches") + 1] == "3"
    gateway_args = specs[-1].args
    assert gateway_args[gateway_args.index("--expect") + 1] == "decode=1,scheduler=1,stage=2"


PREFILL_PIPELINE = UpConfig(model="/models/m", served_model_name="m", nats_url="nats://127.0.0.1:4999",
                            topology="disagg", stage_ranges=((0, 2), (2, 4)), kv_transport="shm", namespace="ns1",
                            kv_store=False)


def test_disagg_with_a_prefill_pipeline_plan():
    specs = plan(PREFILL_PIPELINE)
    assert [s.name for s in specs] == ["scheduler-0", "prefill-stage-1", "prefill-0", "decode-0", "gateway-0"]
    stage, head = specs[1].args, specs[2].args
    assert "--ships-kv" in stage and stage[stage.index("--kv-transport") + 1] == "shm"
    assert head[head.index("--head-role") + 1] == "prefill" and head[head.index("--stages") + 1] == "prefill-stage-1"
    assert specs[2].role == "stage" and specs[3].args[specs[3].args.index("--mode") + 1] == "disagg"
    gateway_args = specs[-1].args
    assert gateway_args[gateway_args.index("--expect") + 1] == "decode=1,scheduler=1,prefill=1,stage=1"
    with pytest.raises(ValueError, match="--prefill must be 1"):
        plan(UpConfig(model="m", served_model_name="m", nats_url="n", topology="disagg", prefill=2,
                      stage_ranges=((0, 2), (2, 4))))


def test_the_planned_pipelines_are_what_each_stage_may_send_along():
    from services.launcher.topology import pipelines_of
    from shared.bus.permissions import Pipeline

    assert pipelines_of(plan(PIPELINE)) == (Pipeline("stage-0", ("stage-1", "stage-2")),)
    assert pipelines_of(plan(PREFILL_PIPELINE)) == (Pipeline("prefill-0", ("prefill-stage-1",)),)
    assert pipelines_of(plan(DISAGG)) == ()


WITH_KV_STORE = UpConfig(model="/models/m", served_model_name="m", nats_url="nats://127.0.0.1:4999", decode=2,
                         kv_store=True, kv_store_ram_bytes=1 << 20, kv_store_disk_bytes=1 << 24, kv_store_dir="/tmp/kv",
                         namespace="ns1")


def test_a_kv_store_plan():
    specs = plan(WITH_KV_STORE)
    assert [s.name for s in specs] == ["scheduler-0", "kvstore-0", "decode-0", "decode-1", "gateway-0"]
    store = specs[1].args
    assert store[store.index("--kv-store-dir") + 1] == "/tmp/kv" and "--kv-store" in specs[2].args
    gateway_args = specs[-1].args
    assert gateway_args[gateway_args.index("--expect") + 1] == "decode=2,scheduler=1,kvstore=1"
    assert "--kv-store" not in plan(CONFIG)[1].args


SECURED = dataclasses.replace(DISAGG, prefill=1, cpus=(4, 5), nats_tls_ca="/etc/nats-ca.pem",
                              transfer_tls=("/t/ca.pem", "/t/cert.pem", "/t/key.pem"), cpu_loan_dir="/run/loans")

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
    "credentials": (dataclasses.replace(PREFILL_PIPELINE, nats_creds_dir="/run/creds"),
                    ("scheduler-0", "prefill-stage-1", "prefill-0", "decode-0", "gateway-0"),
                    {"decode": 1, "scheduler": 1, "prefill": 1, "stage": 1}),
    "secured": (SECURED, ("scheduler-0", "kvstore-0", "prefill-0", "decode-0", "gateway-0"),
                {"decode": 1, "scheduler": 1, "kvstore": 1, "prefill": 1}),
}
# SECURED: one CPU each, so prefill-0 lends its CPU to decode-0 while idle.
SECURED_CPUS = {"prefill-0": (4,), "decode-0": (5,)}


def _role(config: UpConfig, name: str) -> str:
    """A prefill pipeline's stages, its head (prefill-0) included, run as stages."""
    if name.startswith("prefill-stage-") or (name == "prefill-0" and config.stage_ranges):
        return "stage"
    return name.rsplit("-", 1)[0]


def test_each_config_plans_exactly_its_services():
    for config, names, _ in PLANNED.values():
        assert [(s.name, s.role) for s in plan(config)] == [(n, _role(config, n)) for n in names]


def _meaning(config: UpConfig, names: tuple[str, ...], name: str, expect: dict[str, int], settings) -> dict:
    """What service `name` must have been told, worked out from the config alone."""
    role = _role(config, name)
    disagg = config.topology == "disagg"
    kv_store = config.kv_store if config.kv_store is not None else disagg
    told = {"nats": config.nats_url, "namespace": config.namespace, "instance_id": name,
            "nats_creds": f"{config.nats_creds_dir}/{name}.nk" if config.nats_creds_dir else None,
            "nats_tls_ca": config.nats_tls_ca}
    tls = dict(zip(("transfer_tls_ca", "transfer_tls_cert", "transfer_tls_key"), config.transfer_tls or (None,) * 3))
    model = {"model": config.model, "served_model_name": config.served_model_name}
    if role == "scheduler":
        local = config.max_local_prefill if disagg and config.max_local_prefill is not None else None
        return told | {"router": config.router,
                       "max_local_prefill": settings.model_fields["max_local_prefill"].default if local is None else local,
                       "offload_short_prefills": config.offload_short_prefills or not disagg,
                       "prefill_backlog_factor": config.prefill_backlog_factor
                       if disagg and config.prefill_backlog_factor is not None
                       else settings.model_fields["prefill_backlog_factor"].default}
    if role == "gateway":
        return told | model | {"host": config.host, "port": config.port, "expect": expect}
    if role == "kvstore":
        return told | tls | {"kv_store_ram_bytes": config.kv_store_ram_bytes,
                             "kv_store_disk_bytes": config.kv_store_disk_bytes, "kv_store_dir": config.kv_store_dir}
    told |= tls | model | {"dtype": config.dtype, "cpus": SECURED_CPUS.get(name) if config is SECURED else None,
                           "max_num_batched_tokens": config.max_num_batched_tokens
                           or settings.model_fields["max_num_batched_tokens"].default}
    loan = f"{config.cpu_loan_dir}/prefill-0.loan" if config.cpu_loan_dir else None
    if role == "decode":
        paced = config.prefill_beside_decodes_ms
        paced = (DISAGG_PREFILL_BESIDE_DECODES_MS if disagg else None) if paced is None else paced or None
        return told | {"mode": "disagg" if disagg else "colocated", "kv_store": kv_store,
                       "prefill_beside_decodes_ms": paced, "cpu_loan": loan,
                       "borrow_cpus": SECURED_CPUS["prefill-0"] if loan else None}
    if role == "prefill":
        return told | {"kv_transport": config.kv_transport, "kv_store": kv_store, "cpu_loan": loan,
                       "prefill_beside_decodes_ms": None}
    head = name in ("stage-0", "prefill-0")
    index = 0 if head else int(name.rsplit("-", 1)[1])
    later = [n for n in names if _role(config, n) == "stage" and n not in ("stage-0", "prefill-0")]
    return told | {"layers": config.stage_ranges[index], "stages": later if head else None,
                   "microbatches": config.microbatches if head else settings.model_fields["microbatches"].default,
                   "head_role": "prefill" if head and disagg else "decode",
                   "ships_kv": disagg and not head,  # a prefill pool's stages ship their layers' KV
                   "kv_transport": config.kv_transport if disagg else "auto"}


@pytest.mark.parametrize(("config_id", "name"), [(c, n) for c, (_, names, _) in PLANNED.items() for n in names])
def test_every_planned_command_line_parses_to_what_the_config_asked(config_id, name):
    config, names, expect = PLANNED[config_id]
    spec = {s.name: s for s in plan(config)}[name]
    settings = importlib.import_module(f"services.{spec.role}.__main__").settings_of(list(spec.args), environ={})
    parsed = dict(settings)
    if "layers" in parsed:
        parsed["layers"] = (parsed["layers"].start, parsed["layers"].end)
    meaning = _meaning(config, names, name, expect, type(settings))
    assert {k: parsed[k] for k in meaning} == meaning


def test_decode_workers_pace_prompt_chunks_in_disagg_by_default_and_as_told_elsewhere():
    def pacing(config) -> dict[str, str | None]:
        return {s.name: s.args[s.args.index("--prefill-beside-decodes-ms") + 1]
                if "--prefill-beside-decodes-ms" in s.args else None
                for s in plan(config) if s.role in ("decode", "prefill")}

    assert pacing(DISAGG) == {"prefill-0": None, "prefill-1": None, "decode-0": f"{DISAGG_PREFILL_BESIDE_DECODES_MS:g}"}  # prefill has no decodes
    assert pacing(dataclasses.replace(DISAGG, prefill_beside_decodes_ms=0.0))["decode-0"] is None
    colocated = dataclasses.replace(DISAGG, topology="colocated", prefill=0, decode=2)
    assert pacing(colocated) == {"decode-0": None, "decode-1": None}  # the baseline as vLLM runs it
    assert pacing(dataclasses.replace(colocated, prefill_beside_decodes_ms=40.0)) == {"decode-0": "40",
                                                                                     "decode-1": "40"}
