"""A colocated deployment started service by service (scheduler, decode workers, gateway)."""

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from support.processes import free_port, start_service, stop_process, wait_for_http


@dataclass
class Deployment:
    nats_url: str
    namespace: str
    base_url: str
    log_dir: Path
    procs: dict = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)


def start_deployment(nats_url: str, log_dir: Path, model_dir: str, workers: int = 1,
                     expect: str | None = None) -> Deployment:
    namespace = "t" + uuid.uuid4().hex[:10]
    port = free_port()
    bus = ["--nats", nats_url, "--namespace", namespace]
    deployment = Deployment(nats_url, namespace, f"http://127.0.0.1:{port}", log_dir)
    deployment.procs["scheduler"] = start_service("scheduler", [*bus, "--instance-id", "scheduler-0"], log_dir)
    for i in range(workers):
        deployment.procs[f"decode-{i}"] = start_service(
            "decode", [*bus, "--instance-id", f"decode-{i}", "--model", model_dir,
                       "--served-model-name", "splitserve-default-llama", "--kv-cache-bytes", str(64 << 20)], log_dir)
    deployment.procs["gateway"] = start_service(
        "gateway", [*bus, "--instance-id", "gateway-0", "--model", model_dir, "--served-model-name",
                    "splitserve-default-llama", "--port", str(port),
                    "--expect", expect or f"scheduler=1,decode={workers}"], log_dir)
    try:
        wait_for_http(f"{deployment.base_url}/health", 120, list(deployment.procs.values()))
    except BaseException:
        deployment.stop()
        raise
    return deployment
