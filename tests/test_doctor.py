"""`splitserve doctor` on this machine (no GPU here: it says so and checks the rest), and its topology parsing."""

import json
import socket
import subprocess
import sys

import torch

from services.doctor.gpu_topology import parse_topology, summarize_links
from support.processes import ROOT, free_port

TOPO = """\
\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tSYS\tPXB\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tSYS\tSYS\t0-47\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tPHB\tSYS\t48-95\t1\t\tN/A
GPU3\tSYS\tSYS\tPHB\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPXB\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_topology_matrix_calls_out_nvlink_and_pcie_pairs():
    links = {(link.a, link.b): link for link in parse_topology(TOPO)}
    assert len(links) == 6  # 4 GPUs: each pair once, NICs left out
    assert links[("GPU0", "GPU1")].nvlink and links[("GPU0", "GPU1")].description == "NVLink (18 links)"
    assert not links[("GPU0", "GPU3")].nvlink and links[("GPU2", "GPU3")].code == "PHB"
    summary = summarize_links(list(links.values()))
    assert "3 pair(s) over NVLink" in summary and "3 pair(s) over PCIe only (e.g. GPU0-GPU3" in summary
    assert parse_topology("") == [] and summarize_links([]).startswith("one GPU")


def doctor(*args) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "doctor", "--json", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


def test_doctor_reports_every_item(nats_server, default_model, tmp_path):
    port = free_port()
    code, report = doctor("--nats", nats_server.url, "--model", default_model, "--port", str(port),
                          "--run-dir", str(tmp_path / "run"), "--kv-store-dir", str(tmp_path / "kv"),
                          "--gpu-memory-utilization", "0.1")
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 0 and report["ok"], report
    names = set(checks)
    assert {"gpu interconnect", "cpu", "disk (run directory)", "disk (model)", "disk (kv-store)", "nats", "api port",
            "model", "libraries"} <= names
    if torch.cuda.is_available():
        assert checks["gpu 0"]["status"] == "ok" and "gpu driver" in names
        assert checks["gpu 0 memory"]["status"] in ("ok", "fail")
    else:
        assert checks["gpu"]["status"] == "skip" and "no CUDA GPU" in checks["gpu"]["detail"]
        assert checks["gpu memory"]["status"] == "skip" and "no GPU" in checks["gpu memory"]["detail"]
    assert checks["nats"]["status"] == "ok" and "JetStream on" in checks["nats"]["detail"]
    assert checks["model"]["status"] == "ok" and "llama" in checks["model"]["detail"]
    assert checks["api port"]["status"] == "ok"
    assert f"torch {torch.__version__}" in checks["libraries"]["detail"]


def test_doctor_fails_on_what_would_stop_a_deployment(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "model").mkdir()
        code, report = doctor("--nats", f"nats://127.0.0.1:{free_port()}", "--model", str(tmp_path / "model"),
                              "--port", str(port), "--run-dir", str(tmp_path / "run"))
    checks = {c["name"]: c for c in report["checks"]}
    assert code == 1 and not report["ok"]
    assert checks["api port"]["status"] == "fail" and checks["nats"]["status"] == "fail"
    assert checks["model"]["status"] == "fail" and "config.json" in checks["model"]["detail"]


def test_the_port_of_the_run_directorys_own_deployment_is_no_failure(tmp_path):
    import os

    from services.doctor.checks import api_port
    from services.launcher.deployment import Deployment, ServiceRecord, write_deployment
    from services.launcher.procs import process_start_time

    me, started = os.getpid(), process_start_time(os.getpid())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert api_port("127.0.0.1", port, tmp_path)[0].status == "fail"  # no deployment there: taken is taken
        write_deployment(tmp_path, Deployment(
            run_dir=str(tmp_path), namespace="ns", topology="colocated", gateway_url=f"http://127.0.0.1:{port}",
            launcher_pid=me, launcher_start_time=started, state="ready",
            services=[ServiceRecord("gateway-0", "gateway", "gateway-0", pid=me, start_time=started)]))
        (check,) = api_port("127.0.0.1", port, tmp_path)
        assert check.status == "ok" and "this run directory's deployment's gateway" in check.detail
        (other,) = api_port("127.0.0.1", port, tmp_path / "elsewhere")
        assert other.status == "fail"


def test_a_gpu_memory_share_that_others_hold_fails():
    from services.doctor.checks import FAIL, OK, memory_share

    gib = 1 << 30
    assert memory_share(0, 0.9, free_bytes=100 * gib, total_bytes=100 * gib).status == OK
    held = memory_share(1, 0.9, free_bytes=40 * gib, total_bytes=100 * gib)
    assert held.status == FAIL and held.name == "gpu 1 memory" and "90.0 of its 100.0 GiB" in held.detail


def test_doctor_checks_what_up_would_use_from_its_flags_variables_and_config_file(tmp_path):
    from services.cli.doctor import up_settings_of
    from services.cli.main import build_parser

    config = tmp_path / "up.yaml"
    config.write_text("port: 9100\nhost: 0.0.0.0\n")

    def settings(*argv, **environ):
        return up_settings_of(build_parser().parse_args(["doctor", *argv]), environ)

    assert (settings().host, settings().port) == ("127.0.0.1", 8000)  # up's defaults
    assert settings(SPLITSERVE_PORT="9000").port == 9000
    assert (settings("--config", str(config), SPLITSERVE_PORT="9000").host,
            settings(SPLITSERVE_CONFIG=str(config), SPLITSERVE_PORT="9000").port) == ("0.0.0.0", 9000)
    assert settings("--port", "9200", SPLITSERVE_PORT="9000").port == 9200
    assert settings(SPLITSERVE_NATS_URL="nats://10.0.0.1:4222").nats == "nats://10.0.0.1:4222"
    code = subprocess.run([sys.executable, "-m", "services.cli.main", "doctor", "--gpu-memory-utilization", "1.5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert code.returncode == 2 and "argument --gpu-memory-utilization" in code.stderr, code.stderr


def test_doctor_checks_a_nats_cluster_given_as_url_url(nats_server):
    from services.doctor.checks import OK, nats_server as check_nats

    (check,) = check_nats(f"{nats_server.url},{nats_server.url}")
    assert check.status == OK and "JetStream on" in check.detail, check.detail
