"""deploy/k8s: every manifest valid against the Kubernetes API schemas (offline, strict), every container command a
real invocation of its service, probes on the endpoints the services serve, credentials per role from secrets, and
the NATS chart's values a JetStream cluster. No Kubernetes cluster exists here: this is validation, not a run."""

import copy
import importlib
import json

import kubernetes_validate
import pytest
import yaml
from launcher_helpers import ROOT

from services.cli import main as cli_main

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # a release still supported; the schemas ship in kubernetes-validate
ROLES = ("scheduler", "kvstore", "prefill", "decode", "gateway")


def load(path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def resources(kustomization) -> list[dict]:
    return [doc for name in kustomization["resources"] for doc in load(K8S / name)]


def workloads(resources) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in resources if doc["kind"] in ("Deployment", "StatefulSet")}


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


def values_of(env: dict[str, dict]) -> dict[str, str]:
    """The variables with a literal value (those from a Secret or the pod's fields are set by Kubernetes)."""
    return {name: item["value"] for name, item in env.items() if "value" in item}


def apply_json_patch(doc: dict, patch: list[dict]) -> dict:
    """The subset of RFC 6902 the overlay uses: add and replace, `-` to append, `~1` for `/`."""
    doc = copy.deepcopy(doc)
    for op in patch:
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
        if isinstance(target, list):
            target.append(op["value"]) if last == "-" else target.__setitem__(int(last), op["value"])
        else:
            assert op["op"] in ("add", "replace") and (op["op"] == "add" or last in target), op
            target[last] = op["value"]
    return doc


def test_every_manifest_is_valid_kubernetes_in_strict_mode(kustomization, resources):
    assert {path.name for path in K8S.glob("*.yaml")} == {*kustomization["resources"], "kustomization.yaml",
                                                         "nats-values.yaml"}
    for doc in resources:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert {doc["kind"] for doc in resources} == {"Namespace", "Deployment", "StatefulSet", "Service", "Job"}
    assert set(workloads(resources)) == set(ROLES)


def test_each_container_is_its_service_run_as_the_image_runs_it(resources):
    for name, workload in workloads(resources).items():
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert args[:2] == ["serve", name] and container["image"].startswith("splitserve:")
        parsed = cli_main.build_parser().parse_args(args)  # the image's entrypoint is `splitserve`
        assert parsed.name == name
        env = env_of(container)
        service = importlib.import_module(f"services.{name}.__main__").settings_of(args[2:], environ=values_of(env))
        # Its bus settings from the environment the services read (SPLITSERVE_*), its own instance's key only: one
        # pod per instance name (a StatefulSet's first pod, or a Deployment of one that never runs two at once).
        assert env["SPLITSERVE_NATS_URL"]["value"] == "nats://nats:4222"
        assert env["SPLITSERVE_NATS_REPLICAS"]["value"] == "3"  # the chart's cluster of three: one copy on each
        instance = f"{name}-0"
        assert service.instance_id == instance or (env["SPLITSERVE_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
                                                   == "metadata.name" and workload["kind"] == "StatefulSet")
        assert workload["spec"]["replicas"] == 1
        if workload["kind"] == "Deployment":
            assert workload["spec"]["strategy"]["type"] == "Recreate"
        secret = env["SPLITSERVE_NATS_NKEY_SEED"]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": f"splitserve-nats-{instance}", "key": "SPLITSERVE_NATS_NKEY_SEED"}
        # Probes on what it serves: the gateway's port, the others' status endpoint on all interfaces.
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        if name == "gateway":
            assert ports["http"] == int(service.port) and service.host == "0.0.0.0"
        else:
            assert int(env["SPLITSERVE_STATUS_PORT"]["value"]) == ports["status"]
            assert env["SPLITSERVE_STATUS_HOST"]["value"] == "0.0.0.0"
        for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
            assert container[probe]["httpGet"]["path"] == path and container[probe]["httpGet"]["port"] in ports
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        if name in ("prefill", "decode", "kvstore"):  # a side channel: on the pod's IP, which peers dial
            assert env["SPLITSERVE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert container["securityContext"]["runAsUser"] == 1000 and container["securityContext"]["runAsNonRoot"]


def test_the_kv_store_keeps_its_disk_tier_on_a_volume_its_user_owns(resources):
    kvstore = workloads(resources)["kvstore"]
    assert kvstore["kind"] == "StatefulSet"
    (claim,) = kvstore["spec"]["volumeClaimTemplates"]
    (container,) = kvstore["spec"]["template"]["spec"]["containers"]
    args = importlib.import_module("services.kvstore.__main__").settings_of(container["args"][2:],
                                                                            environ=values_of(env_of(container)))
    mount = next(m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert mount["mountPath"] == args.kv_store_dir and args.kv_store_disk_bytes > 0
    assert kvstore["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 1000  # the Dockerfile's user


def test_the_gateway_has_a_service_and_the_expected_counts_match(resources):
    service = next(d for d in resources if d["kind"] == "Service" and d["metadata"]["name"] == "gateway")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    gateway = workloads(resources)["gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    expect = dict(item.split("=") for item in gateway[gateway.index("--expect") + 1].split(","))
    replicas = {name: w["spec"]["replicas"] for name, w in workloads(resources).items()}
    assert {role: int(n) for role, n in expect.items()} == {r: replicas[r] for r in expect}


def test_credentials_come_from_secrets_nats_auth_writes(kustomization, tmp_path):
    secrets = {s["name"]: s for s in kustomization["secretGenerator"]}
    assert cli_main.main(["nats-auth", str(tmp_path / "secrets"), "--namespace", "splitserve"]) == 0
    for instance in [f"{role}-0" for role in ROLES] + ["admin"]:
        (env_file,) = secrets[f"splitserve-nats-{instance}"]["envs"]
        assert env_file == f"secrets/{instance}.env" and (tmp_path / env_file).is_file()
    (auth_file,) = secrets["splitserve-nats-auth"]["files"]
    assert (tmp_path / auth_file).is_file()
    assert "deploy/k8s/secrets/" in (ROOT / ".gitignore").read_text()  # never committed


def test_a_job_provisions_the_streams_with_the_admin_key_no_service_holds(resources):
    (job,) = [doc for doc in resources if doc["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    parsed = cli_main.build_parser().parse_args(container["args"])
    assert parsed.command == "provision" and parsed.nats == "nats://nats:4222" and parsed.nats_replicas == 3
    assert env_of(container)["SPLITSERVE_NATS_NKEY_SEED"]["valueFrom"]["secretKeyRef"]["name"] == "splitserve-nats-admin"
    for workload in workloads(resources).values():
        assert "splitserve-nats-admin" not in json.dumps(workload)


def test_nats_is_the_official_chart_as_a_jetstream_cluster_admitting_only_the_roles(kustomization):
    (chart,) = kustomization["helmCharts"]
    assert chart["name"] == "nats" and chart["repo"] == "https://nats-io.github.io/k8s/helm/charts/"
    values = yaml.safe_load((K8S / chart["valuesFile"]).read_text())
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert values["config"]["jetstream"]["enabled"] and values["config"]["jetstream"]["fileStore"]["pvc"]["size"]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"]]
    (mount,) = [p["value"] for p in values["container"]["patch"]]
    assert volume["secret"]["secretName"] == "splitserve-nats-auth" and mount["name"] == volume["name"]
    assert values["config"]["merge"]["$include"] == f"..{mount['mountPath'].removeprefix('/etc')}/nats-auth.conf"


def test_the_gpu_overlay_gives_each_model_worker_a_gpu(resources):
    overlay = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
    assert overlay["resources"] == [".."]
    patched = set()
    for patch in overlay["patches"]:
        target = workloads(resources)[patch["target"]["name"]]
        result = apply_json_patch(target, yaml.safe_load((K8S / "gpu" / patch["path"]).read_text()))
        kubernetes_validate.validate(result, KUBERNETES_VERSION, strict=True)
        (container,) = result["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        settings = importlib.import_module(f"services.{patch['target']['name']}.__main__").settings_of(
            container["args"][2:], environ=values_of(env_of(container)))
        assert settings.device == "cuda" and settings.gpu_memory_utilization == 0.9
        patched.add(patch["target"]["name"])
    assert patched == {"prefill", "decode"}
