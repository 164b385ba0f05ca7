"""compose/docker-compose.yml and the Dockerfile: valid, and every command a real CLI invocation.

The services' own flags are checked with their own parsers
(`services.NAME.__main__.build_parser()`).
"""

import importlib
import json
import re
import subprocess
import sys
import tomllib
from collections import Counter

import pytest
import yaml
from launcher_helpers import ROOT

from services.cli import main as cli_main
from services.cli import serve
from shared.engine.default_model import DEFAULT_MODEL_NAME
from services.launcher.nats_auth import public_key

COMPOSE = ROOT / "compose" / "docker-compose.yml"
PROJECT_SERVICES = ("scheduler", "kvstore", "prefill", "decode", "gateway")
NATS_NODES = ("nats-0", "nats-1", "nats-2")


@pytest.fixture(scope="module")
def compose() -> dict:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def environment_of(svc: dict) -> dict:
    environment = svc.get("environment") or {}
    return environment if isinstance(environment, dict) else dict(item.split("=", 1) for item in environment)


def _service_main(role: str):
    """services.ROLE.__main__: every project service has one, and an import that breaks fails the test."""
    return importlib.import_module(f"services.{role}.__main__")


def test_the_compose_file_is_sane_compose_yaml(compose):
    assert set(compose) <= {"name", "services", "volumes", "networks"} | {k for k in compose if k.startswith("x-")}
    services = compose["services"]
    assert set(services) == {*NATS_NODES, "jaeger", "prometheus", "grafana", "provision", *PROJECT_SERVICES}
    for name, svc in services.items():
        assert isinstance(svc, dict), name
        assert set(svc) <= {"image", "build", "command", "ports", "volumes", "environment", "depends_on",
                            "restart", "healthcheck", "env_file", "stop_grace_period"}, name
        if name != "grafana":  # (its image's own command)
            assert isinstance(svc.get("command"), list) and all(isinstance(a, str) for a in svc["command"]), name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in (compose.get("volumes") or {}), f"{name}: undeclared volume {source}"

    for node in NATS_NODES:  # a cluster of three, each its own name and store, checked by its /healthz
        nats = services[node]
        assert nats["image"].startswith("nats:") and "build" not in nats
        assert "--jetstream" in nats["command"] and _flag(nats["command"], "--server_name") == node
        assert f"{node}-data:/data" in nats["volumes"]
        assert "http://127.0.0.1:8222/healthz" in nats["healthcheck"]["test"]
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/jaeger:") and jaeger["ports"] == ["127.0.0.1:16686:16686"]
    assert "receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in jaeger["command"]

    images = set()
    for name in PROJECT_SERVICES:
        svc = services[name]
        build = svc["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT, name
        assert (ROOT / build.get("dockerfile", "Dockerfile")).is_file(), name
        images.add(svc["image"])
        depends = svc["depends_on"]
        assert set(NATS_NODES) <= set(depends if isinstance(depends, list) else list(depends)), name
        # Every service has a health check on /ready: the gateway's own port, the others' status endpoint.
        port = "8000" if name == "gateway" else environment_of(svc)["SPLITSERVE_STATUS_PORT"]
        assert f"http://127.0.0.1:{port}/ready" in " ".join(svc["healthcheck"]["test"]), name
        assert "ports" in svc if name == "gateway" else "ports" not in svc, name
        # Each traces into the jaeger service, with the standard OpenTelemetry variables.
        environment = svc["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert environment["OTEL_EXPORTER_OTLP_PROTOCOL"] in ("http/protobuf", "grpc"), name
    assert len(images) == 1  # one project image


def test_the_commands_describe_one_consistent_deployment(compose):
    services = compose["services"]
    commands = {name: services[name]["command"] for name in PROJECT_SERVICES}
    roles = Counter()
    instance_ids = []
    for name, command in commands.items():
        assert command[:2] == ["serve", name]
        roles[command[1]] += 1
        instance_ids.append(_flag(command, "--instance-id"))
        urls = _flag(command, "--nats").split(",")  # every server of the cluster
        assert [re.fullmatch(r"nats://([\w-]+):4222", url).group(1) for url in urls] == list(NATS_NODES)
        # Told the copies (one per node), rather than each going by the nodes it saw on connecting.
        assert environment_of(services[name])["SPLITSERVE_NATS_REPLICAS"] == str(len(NATS_NODES))
        assert _flag(command, "--namespace") == "splitserve"
    assert len(set(instance_ids)) == len(instance_ids)

    gateway = commands["gateway"]
    assert _flag(gateway, "--host") == "0.0.0.0"  # inside the container; published on loopback below
    expect = dict(item.split("=") for item in _flag(gateway, "--expect").split(","))
    assert {role: int(n) for role, n in expect.items()} == {
        "decode": roles["decode"], "scheduler": roles["scheduler"], "prefill": roles["prefill"],
        "kvstore": roles["kvstore"]}
    # Disagg: decode workers listen for KV on the compose network and tell prefill workers where.
    decode = commands["decode"]
    assert _flag(decode, "--mode") == "disagg" and _flag(decode, "--kv-receiver-host") == "0.0.0.0"
    assert _flag(decode, "--kv-receiver-advertise") == "decode"
    # The kv-store: every worker uses it, it listens on the compose network and is published nowhere.
    kvstore = commands["kvstore"]
    assert _flag(kvstore, "--transfer-host") == "0.0.0.0" and _flag(kvstore, "--transfer-advertise") == "kvstore"
    assert "ports" not in services["kvstore"] and _flag(commands["scheduler"], "--router") == "kv"
    for name in ("decode", "prefill"):
        assert "--kv-store" in commands[name]
        assert _flag(commands[name], "--kv-store-receiver-advertise") == name
    for name in ("gateway", "decode", "prefill"):
        # The model baked into the image, named: without --model a service would fetch the default one.
        assert _flag(commands[name], "--model") == _flag(commands[name], "--served-model-name") == DEFAULT_MODEL_NAME
    port = _flag(gateway, "--port")
    for mapping in services["gateway"]["ports"]:
        parts = str(mapping).split(":")
        assert parts[-1] == port and parts[-2].isdigit()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "docker-compose.pipeline.yml"])
def test_nats_admits_each_service_with_its_own_key_from_nats_auth(compose_file, tls, tmp_path):
    services = yaml.safe_load((COMPOSE.parent / compose_file).read_text())["services"]
    secrets = tmp_path / "secrets"
    nodes = [name for name in services if name.startswith("nats")]
    nats = services[nodes[0]]
    mount = next(v for v in nats["volumes"] if v.startswith("./secrets:"))
    server_dir = mount.split(":")[1]
    client_ca = next(v for v in services["gateway"]["volumes"] if v.startswith("./secrets/public:")).split(":")[1]
    # (the server's view of the directory is this one here, so that nats-server can check the config below)
    tls_args = ["--tls-name", "nats", "--server-dir", str(secrets), "--client-ca-path", f"{client_ca}/ca.pem"]
    # A cluster's servers take the file that adds their routes (the header's command names them).
    routes = [arg for node in nodes if len(nodes) > 1 for arg in ("--cluster-route", f"{node}:6222")]
    assert cli_main.main(["nats-auth", str(secrets), "--namespace", "splitserve", *(tls_args if tls else []),
                          *routes]) == 0
    config = "nats-server.conf" if len(nodes) > 1 else "nats-auth.conf"
    assert all(_flag(services[node]["command"], "--config") == f"{server_dir}/{config}" for node in nodes)
    if routes:
        header = (COMPOSE.parent / compose_file).read_text().split("\nname:")[0]
        assert all(f"--cluster-route {node}:6222" in header for node in nodes)
        cluster = (secrets / "nats-cluster.conf").read_text()
        assert all(f"@{node}:6222" in cluster for node in nodes) and (secrets / "nats-cluster.conf").stat().st_mode & 0o077 == 0
    assert (json.loads((secrets / "nats-auth.conf").read_text()).get("tls") is not None) == tls
    for name, svc in services.items():  # every service sees the CA directory (empty without TLS)
        if "command" in svc and svc["command"][:1] == ["serve"]:
            assert f"./secrets/public:{client_ca}:ro" in svc["volumes"], name
    assert (secrets / "public").is_dir() and ((secrets / "public" / "ca.pem").exists() == tls)
    from support.processes import find_nats_server

    checked = subprocess.run([find_nats_server(), "-t", "--config", str(secrets / config), "--server_name", "nats-0"],
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    users = json.loads((secrets / "nats-auth.conf").read_text())["authorization"]["users"]
    for name, svc in services.items():
        if "command" not in svc or svc["command"][:1] not in (["serve"], ["provision"]):
            continue
        # Its own instance's key, no other (the admin key: the one-shot provisioner's only).
        instance = _flag(svc["command"], "--instance-id") if svc["command"][0] == "serve" else "admin"
        assert svc["env_file"] == [f"secrets/{instance}.env"], name
        written = (secrets / f"{instance}.env").read_text()
        assert written.startswith("SPLITSERVE_NATS_NKEY_SEED=SU") and (secrets / f"{instance}.env").stat().st_mode & 0o077 == 0
        assert (f"SPLITSERVE_NATS_TLS_CA={client_ca}/ca.pem" in written) == tls
        seed = written.split("\n")[0].split("=", 1)[1]
        assert any(u["nkey"] == public_key(seed.encode()) for u in users), name  # the server admits it
    assert sum(svc.get("env_file") == ["secrets/admin.env"] for svc in services.values()) == 1
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "compose" in ignored  # the keys never go into an image
    assert "compose/secrets/" in (ROOT / ".gitignore").read_text()


def test_the_dockerfile_builds_the_splitserve_entrypoint():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim AS system\s*$", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["splitserve"\]\s*$', dockerfile, re.M)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["splitserve"] == "services.cli.main:main"
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in dockerfile
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv"} <= ignored
    assert "mkdir -p /data && chown splitserve:splitserve /data" in dockerfile  # the kv-store's volume is writable
    for needed in ("pyproject.toml", "README.md", "services", "shared", "contracts"):
        assert needed not in ignored and (ROOT / needed).exists()


@pytest.mark.parametrize("name", PROJECT_SERVICES)
def test_each_compose_command_is_a_real_cli_invocation(compose, name):
    command = compose["services"][name]["command"]
    # `splitserve serve NAME ARGS...` parses with the splitserve CLI...
    args = cli_main.build_parser().parse_args(command)
    assert args.run is serve.run and args.name == name and args.args == command[2:]
    # ...the service answers --help, directly and through `splitserve serve`...
    module = _service_main(name)
    for argv in (["-m", f"services.{name}", "--help"], ["-m", "services.cli.main", "serve", name, "--help"]):
        result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout and "--nats" in result.stdout
    # ...and its settings come from the actual flags and environment.
    parsed = module.settings_of(command[2:], environ=environment_of(compose["services"][name]))
    assert parsed.nats == _flag(command, "--nats")
    assert parsed.namespace == _flag(command, "--namespace")
    assert parsed.instance_id == _flag(command, "--instance-id")


def test_the_provisioner_makes_the_streams_with_the_admin_key_before_the_services(compose):
    provision = compose["services"]["provision"]
    args = cli_main.build_parser().parse_args(provision["command"])
    assert args.command == "provision" and args.namespace == "splitserve" and args.nats_replicas == 3
    assert sorted(args.nats.split(",")) == sorted(f"nats://{node}:4222" for node in NATS_NODES)
    assert provision["depends_on"] == list(NATS_NODES) and provision["restart"] == "on-failure"


def test_prometheus_scrapes_the_gateway_and_the_dashboard_reads_metrics_it_serves(compose):
    services = compose["services"]
    config = yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    gateway_port = _flag(services["gateway"]["command"], "--port")
    assert job["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"] and job["metrics_path"] == "/metrics"
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    assert {name: services[name]["ports"] for name in ("prometheus", "grafana")} == {
        "prometheus": ["127.0.0.1:9090:9090"], "grafana": ["127.0.0.1:3000:3000"]}  # the host's loopback only
    for name in ("prometheus", "grafana", *NATS_NODES, *PROJECT_SERVICES):  # every service but jaeger checks itself
        assert services[name].get("healthcheck") or compose["x-splitserve"].get("healthcheck"), name
    # The dashboard: provisioned from the repo, every query on a metric the gateway exports.
    dashboard = json.loads((COMPOSE.parent / "grafana" / "dashboards" / "splitserve.json").read_text())
    source = "".join((ROOT / path).read_text() for path in ("services/gateway/metrics.py",
                                                             "services/common/service_metrics.py"))
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"(?:splitserve_|vllm:)\w+", target["expr"]):
                # A counter's or histogram's series carries a suffix its name does not (a gauge may end in _total).
                base = re.sub(r"_(bucket|total|sum|count)$", "", metric)
                assert f'"{metric}"' in source or f'"{base}"' in source, (panel["title"], metric)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for shown in ("first token", "inter-token", "queue", "kv cache", "transfer", "hit rate"):
        assert shown in titles
    datasource = yaml.safe_load((COMPOSE.parent / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((COMPOSE.parent / "grafana/provisioning/dashboards/splitserve.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in services["grafana"]["volumes"]


def test_the_gpu_override_runs_each_model_worker_on_its_own_gpu_with_the_cuda_image(compose):
    override = yaml.safe_load((COMPOSE.parent / "docker-compose.gpu.yml").read_text())
    assert set(override["services"]) == {"prefill", "decode"}
    gpus = []
    for name, svc in override["services"].items():
        base = compose["services"][name]
        assert svc["image"] == "splitserve:cuda" and svc["build"]["args"]["TORCH"] == "cuda"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        # compose merges the environments: the worker's settings are the base command's, on the GPU.
        settings = _service_main(name).settings_of(base["command"][2:],
                                                   environ={**environment_of(base), **environment_of(svc)})
        assert settings.device == "cuda" and settings.gpu_memory_utilization == 0.9
    assert sorted(gpus) == ["0", "1"]  # one GPU each
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH=cpu$", dockerfile, re.M) and re.search(r"^FROM torch-\$\{TORCH\}$", dockerfile, re.M)
    assert re.search(r"^FROM system AS torch-cuda\nRUN pip install torch==2\.13\.0$", dockerfile, re.M)
