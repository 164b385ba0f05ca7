"""A colocated deployment started service by service (scheduler, decode workers, gateway)."""

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nats

from contracts import ServiceInfo, ServiceStats, StatsRequest, Subjects, model_namespace
from services.gateway.readiness import fully_ready
from shared.bus.registry import Registry

from support.processes import free_port, start_service, stop_process, stop_processes, wait_for_http
from support.token_tap import TokenTap


@dataclass
class Deployment:
    nats_url: str
    namespace: str
    base_url: str
    log_dir: Path
    procs: dict = field(default_factory=dict)
    commands: dict = field(default_factory=dict)  # name -> (service, args), to restart one
    tap: TokenTap | None = None  # every token chunk sent to gateway-0, from once the deployment is ready
    status_url: str | None = None  # a pipeline head's own status server, where it has one
    model_namespaces: dict = field(default_factory=dict)  # each further model's namespace, by its served name

    def start(self, name: str, service: str, args: list[str]) -> None:
        self.commands[name] = (service, args)
        self.procs[name] = start_service(service, args, self.log_dir)

    def restart(self, name: str) -> None:
        """Start a (killed) service again with the same command line."""
        stop_process(self.procs[name])
        self.start(name, *self.commands[name])

    def stats(self, instance: str, namespace: str | None = None) -> ServiceStats:
        """What a service (of the deployment's namespace, or of `namespace`) says of itself now."""
        async def ask():
            nc = await nats.connect(self.nats_url)
            try:
                reply = await nc.request(Subjects(namespace or self.namespace).stats(instance), StatsRequest().encode(),
                                         timeout=5)
                return ServiceStats.decode(reply.data)
            finally:
                await nc.close()
        return asyncio.run(ask())

    def publish(self, subject: str, message) -> None:
        """Publish `message` (a contract) on the deployment's bus, as any process that reaches NATS could."""
        async def send():
            nc = await nats.connect(self.nats_url)
            try:
                await nc.publish(subject, message.encode())
                await nc.flush()
            finally:
                await nc.close()
        asyncio.run(send())

    def registered(self) -> set[str]:
        """The instance ids in the deployment's registry now."""
        return set(self.registry_entries())

    def registry_entries(self) -> dict[str, ServiceInfo]:
        """The deployment's registry now (what the scheduler routes by), by instance id."""
        async def ask():
            nc = await nats.connect(self.nats_url)
            try:
                registry = await Registry.open(nc.jetstream(), Subjects(self.namespace).registry_bucket)
                return {info.instance_id: info for info in await registry.list()}
            finally:
                await nc.close()
        return asyncio.run(ask())

    def wait_scheduler_sees(self, role: str, count: int, timeout_s: float = 15.0, namespace: str | None = None) -> None:
        """Until the scheduler's view of the registry (refreshed twice a second) holds `count` ready `role`s."""
        deadline = time.monotonic() + timeout_s
        while self.stats("scheduler-0", namespace).details["workers_seen"].get(role, 0) < count:
            assert time.monotonic() < deadline, f"the scheduler does not see {count} {role} worker(s)"
            time.sleep(0.1)

    def token_ids(self, body: dict) -> list[int]:
        """The output token ids of the request a response `body` answered, as the workers streamed them."""
        return self.tap.token_ids(body)

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self) -> None:
        if self.tap is not None:
            self.tap.close()
            self.tap = None
        stop_processes(self.procs.values())
        self.delete_streams()

    def delete_streams(self) -> None:
        """Delete the namespace's JetStream streams (its queues, its registry bucket): each reserves its byte
        bound on the server, which a session's worth of deployments would otherwise run out of."""
        async def delete():
            nc = await nats.connect(self.nats_url)
            try:
                js = nc.jetstream()
                for name in await js.streams_info():
                    if self.namespace in name.config.name:
                        await js.delete_stream(name.config.name)
            finally:
                await nc.close()
        try:
            asyncio.run(delete())
        except Exception as exc:  # a server stopped already (a test's own) has nothing left to free
            print(f"could not delete the streams of {self.namespace}: {exc!r}")


def _ready(deployment: Deployment) -> Deployment:
    """Once /ready says every service is ready, with the token tap listening; stopped if not."""
    try:
        wait_for_http(f"{deployment.base_url}/ready", 120, list(deployment.procs.values()),
                      ok=lambda response: fully_ready(response.status_code, response.text))
        deployment.tap = TokenTap(deployment.nats_url, deployment.namespace)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def start_deployment(nats_url: str, log_dir: Path, model_dir: str, workers: int = 1,
                     expect: str | None = None, prefill: int = 0, scheduler_args: tuple = (),
                     decode_args: tuple = (), prefill_args: tuple = (),
                     prefill_split: list[tuple[int, int]] | None = None, kvstore_args: tuple | None = None,
                     kvstores: int = 1, gateway_args: tuple = (), gateway_env: dict[str, str] | None = None,
                     schedulers: int = 1, also_serve: tuple = ()) -> Deployment:
    """`schedulers` schedulers (scheduler-0, ...), `prefill` prefill workers, `workers` decode workers and
    gateway-0 on a fresh namespace.

    `also_serve`: further models, (served name, model directory, decode worker flags), each with its own
    scheduler-0 and decode-0 in its own namespace (`contracts.model_namespace`, as `up` places them), which the
    gateway serves too (`--also-serve`).

    With prefill workers, the decode workers run in disagg mode. With `prefill_split`, the prefill pool is
    one pipeline (prefill-0 its head, prefill-stage-1.. the rest), each stage shipping its own layers' KV.
    With `kvstore_args` (a tuple, maybe empty), `kvstores` kv-stores kvstore-0.. run too (with a disk tier,
    each in a directory of its own).
    """
    namespace = "t" + uuid.uuid4().hex[:10]
    port = free_port()
    bus = ["--nats", nats_url, "--namespace", namespace]
    model = ["--model", model_dir, "--served-model-name", "splitserve-default-llama"]
    deployment = Deployment(nats_url, namespace, f"http://127.0.0.1:{port}", log_dir)
    for i in range(schedulers):  # the first is procs["scheduler"], the others "scheduler-1", ...
        deployment.start("scheduler" if i == 0 else f"scheduler-{i}", "scheduler",
                         [*bus, "--instance-id", f"scheduler-{i}", *scheduler_args])
    for i in range(prefill if not prefill_split else 0):
        deployment.start(f"prefill-{i}", "prefill", [*bus, "--instance-id", f"prefill-{i}", *model,
                                                     "--kv-cache-bytes", str(64 << 20), *prefill_args])
    stages = [f"prefill-stage-{i}" for i in range(1, len(prefill_split or ()))]
    for iid, (start, end) in zip(stages, (prefill_split or [])[1:]):
        deployment.start(iid, "stage", [*bus, "--instance-id", iid, *model, "--layers", f"{start}:{end}", "--ships-kv",
                                        "--kv-cache-bytes", str(64 << 20), *prefill_args])
    if prefill_split:
        start, end = prefill_split[0]
        deployment.start("prefill-0", "stage", [*bus, "--instance-id", "prefill-0", *model, "--layers", f"{start}:{end}",
                                                "--stages", ",".join(stages), "--head-role", "prefill",
                                                "--kv-cache-bytes", str(64 << 20), *prefill_args])
        prefill = 1
    for i in range(kvstores if kvstore_args is not None else 0):
        disk = ["--kv-store-dir", str(log_dir / f"kvstore-{i}")] if "--kv-store-disk-bytes" in kvstore_args else []
        deployment.start(f"kvstore-{i}", "kvstore", [*bus, "--instance-id", f"kvstore-{i}", *kvstore_args, *disk])
    mode = ["--mode", "disagg" if prefill else "colocated"]
    for i in range(workers):
        deployment.start(f"decode-{i}", "decode", [*bus, "--instance-id", f"decode-{i}", *model, *mode,
                                                   "--kv-cache-bytes", str(64 << 20), *decode_args])
    served = [arg for name, model_dir, args in also_serve
              for arg in ("--also-serve", _model_pools(deployment, name, model_dir, args))]
    counts = (f"scheduler={schedulers},decode={workers}" + (f",prefill={prefill}" if prefill else "")
              + (f",stage={len(stages)}" if stages else "") + (f",kvstore={kvstores}" if kvstore_args is not None else ""))
    deployment.procs["gateway"] = start_service(
        "gateway", [*bus, "--instance-id", "gateway-0", *model, "--port", str(port), "--expect", expect or counts,
                    "--drain-timeout", "2", *served, *gateway_args], log_dir, **(gateway_env or {}))
    _ready(deployment)
    if expect is None:
        # /ready is the gateway's view of the registry; the scheduler refreshes its own: until it sees the
        # workers too, it routes as if they were not there (a prefill pool not seen yet means "local").
        try:
            deployment.wait_scheduler_sees("decode", workers)
            if prefill:
                deployment.wait_scheduler_sees("prefill", prefill)
            for namespace in deployment.model_namespaces.values():
                deployment.wait_scheduler_sees("decode", 1, namespace=namespace)
        except BaseException:
            deployment.stop()
            raise
    return deployment


def _model_pools(deployment: Deployment, name: str, model_dir: str, decode_args: tuple) -> str:
    """Another model's scheduler-0 and decode-0, in a namespace of its own (logging under log_dir/NAME); what
    the gateway's --also-serve says of it."""
    namespace = deployment.model_namespaces[name] = model_namespace(deployment.namespace, name)
    log_dir = deployment.log_dir / namespace
    log_dir.mkdir(exist_ok=True)
    bus = ["--nats", deployment.nats_url, "--namespace", namespace]
    deployment.procs[f"{name}/scheduler"] = start_service("scheduler", [*bus, "--instance-id", "scheduler-0"], log_dir)
    deployment.procs[f"{name}/decode"] = start_service("decode", [
        *bus, "--instance-id", "decode-0", "--model", model_dir, "--served-model-name", name, "--mode", "colocated",
        "--kv-cache-bytes", str(64 << 20), *decode_args], log_dir)
    return f"{name}={model_dir}@{namespace}"


def start_pipeline(nats_url: str, log_dir: Path, model_dir: str, split: list[tuple[int, int]],
                   microbatches: int = 2, head_args: tuple = (), stage_args: tuple = (),
                   head_status: bool = False) -> Deployment:
    """scheduler-0, a pipeline of `len(split)` stages (stage-0 the head) and gateway-0 on a fresh namespace; with
    `head_status`, the head serves its own status (`status_url`)."""
    namespace = "t" + uuid.uuid4().hex[:10]
    port = free_port()
    bus = ["--nats", nats_url, "--namespace", namespace]
    model = ["--model", model_dir, "--served-model-name", "splitserve-default-llama"]
    deployment = Deployment(nats_url, namespace, f"http://127.0.0.1:{port}", log_dir)
    if head_status:
        status_port = free_port()
        deployment.status_url = f"http://127.0.0.1:{status_port}"
        head_args = (*head_args, "--status-port", str(status_port))
    deployment.procs["scheduler"] = start_service("scheduler", [*bus, "--instance-id", "scheduler-0"], log_dir)
    stages = [f"stage-{i}" for i in range(1, len(split))]
    for iid, (start, end) in zip(stages, split[1:]):
        deployment.start(iid, "stage", [*bus, "--instance-id", iid, *model, "--layers", f"{start}:{end}",
                                        "--kv-cache-bytes", str(64 << 20), *stage_args])
    start, end = split[0]
    deployment.procs["stage-0"] = start_service(
        "stage", [*bus, "--instance-id", "stage-0", *model, "--layers", f"{start}:{end}", "--stages", ",".join(stages),
                  "--microbatches", str(microbatches), "--kv-cache-bytes", str(64 << 20), *head_args], log_dir)
    deployment.procs["gateway"] = start_service(
        "gateway", [*bus, "--instance-id", "gateway-0", *model, "--port", str(port),
                    "--expect", f"scheduler=1,decode=1,stage={len(stages)}"], log_dir)
    return _ready(deployment)
