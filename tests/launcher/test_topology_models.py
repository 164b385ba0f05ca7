"""What `splitserve up --model A --model B:...` plans: one NATS and one gateway; each model's scheduler, workers and
kv-store in its own namespace (the first model's in the deployment's, under today's names; a further one's under
its prefix mK-), told its own model; the gateway told every further model (`--also-serve NAME=MODEL@NAMESPACE`);
each instance's credential for its own namespace, the gateway's for all of them."""

import importlib

import pytest
from bus.test_permissions import allows
from launcher_helpers import up_and_run

from services.common.settings import secret_env
from services.gateway.settings import GatewayServiceSettings
from services.launcher import topology
from services.launcher.model_spec import ModelSpec
from services.launcher.nats_auth import Instance, authorization_config
from services.launcher.served_models import further_model
from shared.bus.permissions import Pipeline

GATEWAY_TAKES_MODELS = "also_serve" in GatewayServiceSettings.model_fields  # issue 38's gateway part
# Model A's (the first's, in namespace dep), which a worker of model B (m1-decode-0, in dep-b) must not reach.
MODEL_A_SUBJECTS = ("dep.worker.decode-0.generate", "dep.worker.m1-decode-0.generate", "dep.scheduler.submit",
                    "dep.tokens.gateway-0.r1.decode.m1-decode-0", "dep.kv.events.decode.m1-decode-0",
                    "dep.load.decode.m1-decode-0", "dep.prefill.jobs", "dep.control.cancel",
                    "$KV.dep-registry.decode.m1-decode-0", "$JS.API.STREAM.INFO.KV_dep-registry",
                    "$JS.API.STREAM.INFO.dep-prefill", "_INBOX.dep.scheduler.scheduler-0.x.1",
                    "_INBOX.dep.decode.m1-decode-0.x.1", "dep.stats.m1-decode-0")


def parsed(spec):
    module = importlib.import_module(f"services.{spec.role}.__main__")
    return module.settings_of(list(spec.args), environ=secret_env(spec.settings))


def two_models(b: ModelSpec, c: ModelSpec | None = None, **given):
    """(specs, further models) of a deployment of /models/m (served as m) and `b` (and `c`) in namespace dep."""
    up, run = up_and_run(**{"namespace": "dep", "topology": "colocated", **given})
    further = tuple(further_model(up, spec, index, f"/models/{spec.name}", spec.name)
                    for index, spec in enumerate([s for s in (b, c) if s is not None], start=1))
    return topology.plan(up, run, further), further


def test_each_model_runs_its_pools_in_its_own_namespace_under_its_own_names():
    specs, (b,) = two_models(ModelSpec(model="B", name="b", topology="disagg", prefill=2), dtype="float32")
    assert [(s.name, s.role, s.namespace) for s in specs] == [
        ("scheduler-0", "scheduler", "dep"), ("decode-0", "decode", "dep"),
        ("m1-scheduler-0", "scheduler", "dep-b"), ("m1-kvstore-0", "kvstore", "dep-b"),  # disagg: a kv-store
        ("m1-prefill-0", "prefill", "dep-b"), ("m1-prefill-1", "prefill", "dep-b"), ("m1-decode-0", "decode", "dep-b"),
        ("gateway-0", "gateway", "dep")]
    assert b.namespace == "dep-b" and b.prefix == "m1-"
    told = {s.name: parsed(s) for s in specs if s.role != "gateway"}
    assert (told["decode-0"].model, told["decode-0"].served_model_name) == ("/models/m", "m")
    for name in ("m1-prefill-0", "m1-decode-0"):
        assert (told[name].model, told[name].served_model_name, told[name].dtype, told[name].instance_id) == (
            "/models/b", "b", "float32", name)
        assert told[name].kv_store and told[name].nats_creds is None
    assert told["m1-decode-0"].mode == "disagg" and told["decode-0"].mode == "colocated"
    gateway = specs[-1]
    assert gateway.args[gateway.args.index("--also-serve") + 1] == "b=/models/b@dep-b"
    assert gateway.settings.expect == {"decode": 1, "scheduler": 1}  # the first model's, as before


def test_the_gateway_is_told_every_further_model_in_the_exact_flag_format():
    specs, _ = two_models(ModelSpec(model="B", name="b"), ModelSpec(model="C", name="Org/C.1"))
    gateway = specs[-1]
    values = [gateway.args[i + 1] for i, arg in enumerate(gateway.args) if arg == "--also-serve"]
    # NAME split at the first '=', NAMESPACE at the last '@': a name that makes no token gets a hashed namespace.
    assert values[0] == "b=/models/b@dep-b"
    name, _, rest = values[1].partition("=")
    model, _, namespace = rest.rpartition("@")
    assert (name, model) == ("Org/C.1", "/models/Org/C.1") and namespace.startswith("dep-org-c-1-")
    assert [s.name for s in specs if s.namespace == namespace] == ["m2-scheduler-0", "m2-decode-0"]
    if GATEWAY_TAKES_MODELS:  # the gateway's part merged: the flags parse back into its settings
        assert parsed(gateway) == gateway.settings


def test_every_further_models_command_line_parses_back_equal():
    specs, _ = two_models(ModelSpec(model="B", name="b", topology="disagg", kv_store=False),
                          nats_creds_dir="/run/creds")
    for spec in specs:
        if spec.role != "gateway":
            assert parsed(spec) == spec.settings, spec.name
            assert spec.settings.nats_creds == f"/run/creds/{spec.name}.nk"


def test_a_further_pipeline_keeps_its_stages_and_sends_only_along_them():
    b = ModelSpec(model="B", name="b", topology="pipeline")
    up, run = up_and_run(namespace="dep", topology="colocated")
    from services.launcher.served_models import FurtherModel, further_settings

    pipeline = FurtherModel(further_settings(up, b, "b"), "/models/b", "m1-", None, ((0, 2), (2, 4)))
    specs = topology.plan(up, run, (pipeline,))
    assert [s.name for s in specs if s.namespace == "dep-b"] == ["m1-scheduler-0", "m1-stage-1", "m1-stage-0"]
    assert parsed(next(s for s in specs if s.name == "m1-stage-0")).stages == ["m1-stage-1"]
    assert topology.pipelines_of(specs) == (Pipeline("m1-stage-0", ("m1-stage-1",)),)


@pytest.mark.parametrize("b_cpus, wanted", [
    (None, {"decode-0": (0, 1), "m1-decode-0": (2, 3)}),  # the models share up's CPUs out together
    ("0", {"decode-0": (0, 1, 2, 3), "m1-decode-0": (0,)}),  # a model with CPUs of its own keeps to them
])
def test_the_models_share_ups_cpus_unless_one_has_its_own(b_cpus, wanted):
    import os

    if b_cpus is not None and 0 not in os.sched_getaffinity(0):
        pytest.skip("needs CPU 0")
    specs, _ = two_models(ModelSpec(model="B", name="b", cpus=b_cpus), cpus=(0, 1, 2, 3))
    assert {s.name: tuple(s.settings.cpus) for s in specs if s.role == "decode"} == wanted


def test_each_instance_is_admitted_to_its_own_namespace_and_the_gateway_to_every_models():
    specs, _ = two_models(ModelSpec(model="B", name="b"))
    instances = {i.instance_id: i for i in topology.instances_of(specs)}
    assert instances["decode-0"] == Instance("decode", "decode-0", ("dep",))
    assert instances["m1-decode-0"] == Instance("decode", "m1-decode-0", ("dep-b",))
    assert instances["gateway-0"] == Instance("gateway", "gateway-0", ("dep", "dep-b"))
    config = authorization_config({i: f"U{n}" for n, i in enumerate(instances.values())}, "dep")
    users = {u["nkey"]: u["permissions"] for u in config["authorization"]["users"]}
    keys = {i.instance_id: f"U{n}" for n, i in enumerate(instances.values())}
    b_worker, gateway = users[keys["m1-decode-0"]], users[keys["gateway-0"]]
    assert allows(b_worker["subscribe"]["allow"], "dep-b.worker.m1-decode-0.generate")
    assert allows(b_worker["publish"]["allow"], "dep-b.tokens.gateway-0.r1.decode.m1-decode-0")
    for subject in MODEL_A_SUBJECTS:  # model A's: B's worker neither sends there nor hears them
        assert not allows(b_worker["publish"]["allow"], subject) and not allows(b_worker["subscribe"]["allow"], subject)
    assert {"dep.tokens.gateway-0.*.*.*", "dep-b.tokens.gateway-0.*.*.*"} <= set(gateway["subscribe"]["allow"])
    assert {"dep.scheduler.submit", "dep-b.scheduler.submit"} <= set(gateway["publish"]["allow"])


def test_nats_auth_issues_keys_for_a_further_models_namespace_and_the_gateway_spans_them(tmp_path, capsys):
    """For a --nats server: `--instance ROLE:ID@NAMESPACE` is a further model's service, its key for that namespace
    alone; the gateway's key spans every namespace the directory knows, kept across runs."""
    import json

    from services.cli import main as cli_main

    def permissions() -> dict[str, dict]:
        from services.launcher.nats_auth import public_key

        users = json.loads((tmp_path / "nats-auth.conf").read_text())["authorization"]["users"]
        by_key = {u["nkey"]: u["permissions"] for u in users}
        return {name: by_key[public_key((tmp_path / f"{name}.nk").read_bytes())]
                for name in ("gateway-0", "decode-0", "m1-decode-0") if (tmp_path / f"{name}.nk").exists()}

    base = ["nats-auth", str(tmp_path), "--namespace", "dep"]
    assert cli_main.main([*base, "--instance", "gateway:gateway-0", "--instance", "decode:decode-0"]) == 0
    assert not allows(permissions()["gateway-0"]["subscribe"]["allow"], "dep-b.tokens.gateway-0.r1.decode.x")
    assert cli_main.main([*base, "--instance", "decode:m1-decode-0@dep-b"]) == 0
    said = capsys.readouterr().out
    assert "--namespace dep-b` (once" in said  # each namespace provisioned
    for run in range(2):  # the second run, with nothing new, keeps it all
        users = permissions()
        assert allows(users["gateway-0"]["subscribe"]["allow"], "dep-b.tokens.gateway-0.r1.decode.m1-decode-0")
        assert allows(users["gateway-0"]["subscribe"]["allow"], "dep.tokens.gateway-0.r1.decode.decode-0")
        assert allows(users["m1-decode-0"]["subscribe"]["allow"], "dep-b.worker.m1-decode-0.generate")
        for subject in MODEL_A_SUBJECTS:
            assert not allows(users["m1-decode-0"]["publish"]["allow"], subject), subject
            assert not allows(users["m1-decode-0"]["subscribe"]["allow"], subject), subject
        assert cli_main.main(base) == 0
    with pytest.raises(SystemExit):
        cli_main.main([*base, "--instance", "decode:m1-decode-1@"])
