"""Which services a topology runs, and with which flags.

Pure: no processes, no I/O. `splitserve up` starts what `plan()` returns; the
tests parse every planned command line with the service's own parser, so the
launcher and the services cannot drift apart silently.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from services.common.cpus import format_cpu_list, pair_cpu_loans, share_cpus
from services.launcher.nats_auth import creds_path
from shared.bus.permissions import Pipeline

TOPOLOGIES = ("colocated", "disagg", "pipeline")


@dataclass(frozen=True)
class UpConfig:
    """What `splitserve up` was asked for (model already resolved)."""

    model: str
    served_model_name: str
    nats_url: str
    topology: str = "colocated"
    decode: int = 1
    prefill: int = 1  # disagg: prefill workers
    max_local_prefill: int | None = None  # disagg: the scheduler's threshold (None: its default)
    offload_short_prefills: bool = True  # disagg: shorter prompts too, to an idle prefill worker, when decode is busy
    prefill_backlog_factor: float | None = None  # disagg: long prompts local behind this deep a backlog (None: default)
    migration_limit: int | None = None  # the gateway's --migration-limit (None: its default)
    max_waiting_requests: int | None = None  # the gateway's --max-waiting-requests (None: its default)
    chat_template: str | None = None  # the gateway's --chat-template (a file's absolute path, or the text)
    share_prefix_cache: bool = False  # the gateway's --share-prefix-cache: API keys reuse each other's prefixes
    protect_metrics: bool = False  # the gateway's --protect-metrics: /metrics needs an API key too
    drain_timeout_s: float | None = None  # the gateway's and decode workers' --drain-timeout (None: theirs)
    kv_transport: str = "auto"  # disagg: how prefill workers ship KV
    stage_ranges: tuple[tuple[int, int], ...] = ()  # pipeline (or disagg's prefill pipeline): each stage's layers
    microbatches: int = 2  # pipeline: steps in flight at once
    host: str = "127.0.0.1"
    port: int = 8000
    namespace: str = "splitserve"
    dtype: str = "auto"
    max_num_batched_tokens: int | None = None  # every worker's token budget per step (None: the engine's default)
    # Decode workers' stall-free chunking target (None: DISAGG_PREFILL_BESIDE_DECODES_MS in disagg, else off; 0: off).
    prefill_beside_decodes_ms: float | None = None
    # A kv-store (kvstore-0) the workers load prefixes from and write blocks back to (None: on for disagg).
    kv_store: bool | None = None
    router: str = "kv"  # the scheduler's: "kv" (cached prefix and load) or "load"
    kv_store_ram_bytes: int = 1 << 30
    kv_store_disk_bytes: int = 0
    kv_store_dir: str | None = None  # the disk tier's directory (needed with kv_store_disk_bytes)
    cpus: tuple[int, ...] = ()  # shared out among the model workers (decode, prefill, stage); () leaves it to the OS
    nats_creds_dir: str | None = None  # each service gets `--nats-creds DIR/INSTANCE_ID.nk` (None: no credentials)
    nats_tls_ca: str | None = None  # each service talks TLS to NATS, trusting this CA
    nats_replicas: int | None = None  # each service's `--nats-replicas` (None: theirs, by the cluster's size)
    transfer_tls: tuple[str, str, str] | None = None  # (CA, cert, key): every side channel speaks TLS only
    cpu_loan_dir: str | None = None  # disagg: idle prefill workers lend their CPUs to decode workers (loan files here)
    device: str = "cpu"  # every model worker's (cpu, cuda, cuda:N), unless its pool's own says otherwise
    prefill_device: str | None = None  # the prefill pool's (None: `device`)
    decode_device: str | None = None  # the decode pool's, a colocated or pipeline deployment's workers too
    gpu_memory_utilization: float | None = None  # on a GPU: each worker's share of its memory (None: fixed KV bytes)


@dataclass(frozen=True)
class ServiceSpec:
    """One service process: `python -m services.ROLE ARGS...`."""

    name: str  # unique in the deployment; also the log file's name
    role: str  # gateway, scheduler, decode, ...
    instance_id: str
    args: tuple[str, ...] = field(default_factory=tuple)
    url: str | None = None  # what it serves, for `ps`

    @property
    def module(self) -> str:
        return f"services.{self.role}"

    def argv(self, python: str | None = None) -> list[str]:
        return [python or sys.executable, "-m", self.module, *self.args]


def _engine_flags(config: UpConfig) -> tuple[str, ...]:
    """The engine settings every worker (decode, prefill, stage) gets alike."""
    flags = ("--dtype", config.dtype)
    if config.max_num_batched_tokens is not None:
        flags += ("--max-num-batched-tokens", str(config.max_num_batched_tokens))
    return flags


def _pacing_flags(config: "UpConfig") -> tuple[str, ...]:
    ms = decode_pacing_ms(config)
    return () if ms is None else ("--prefill-beside-decodes-ms", f"{ms:g}")


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def http_url(host: str, port: int) -> str:
    host = connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def expect_arg(counts: dict[str, int]) -> str:
    """The gateway's `--expect`: `decode=2,scheduler=1`."""
    return ",".join(f"{role}={n}" for role, n in counts.items())


ENGINE_ROLES = ("decode", "prefill", "stage")
SIDE_CHANNEL_ROLES = (*ENGINE_ROLES, "kvstore")  # the services that move KV or activations outside NATS
# In disagg a decode worker still prefills short prompts (and long ones when no prefill worker can); pacing
# those chunks keeps its running requests' tokens flowing. On a 2-core CPU, the mixed load (short-request ITL
# p99, one run each): float32 200 ms: 246 ms, 130 ms: 164 ms; bfloat16 200 ms: 210 ms, 130 ms: 136 ms; no
# cost in tokens/s at concurrency 16 nor in the mixed wall time (within this machine's drift).
DISAGG_PREFILL_BESIDE_DECODES_MS = 130.0


def decode_pacing_ms(config: "UpConfig") -> float | None:
    """The decode workers' `--prefill-beside-decodes-ms` (None: not paced)."""
    ms = config.prefill_beside_decodes_ms
    if ms is None:
        ms = DISAGG_PREFILL_BESIDE_DECODES_MS if config.topology == "disagg" else 0.0
    return ms or None


def plan(config: UpConfig) -> list[ServiceSpec]:
    """The services of the deployment, in start order (the gateway last); model workers each on their own CPUs."""
    specs = _plan(config)
    workers = [s.name for s in specs if s.role in ENGINE_ROLES]
    shares = share_cpus(workers, config.cpus)
    specs = [dataclasses.replace(s, args=(*s.args, "--cpus", format_cpu_list(shares[s.name])))
             if s.name in shares else s for s in specs]
    if config.cpu_loan_dir is not None and config.topology == "disagg":
        specs = _with_cpu_loans(specs, shares, config.cpu_loan_dir)
    specs = [dataclasses.replace(s, args=(*s.args, *_device_flags(config, s))) if s.role in ENGINE_ROLES else s
             for s in specs]
    if config.nats_tls_ca is not None:
        specs = [dataclasses.replace(s, args=(*s.args, "--nats-tls-ca", config.nats_tls_ca)) for s in specs]
    if config.nats_replicas is not None:
        specs = [dataclasses.replace(s, args=(*s.args, "--nats-replicas", str(config.nats_replicas))) for s in specs]
    if config.transfer_tls is not None:
        ca, cert, key = config.transfer_tls
        specs = [dataclasses.replace(s, args=(*s.args, "--transfer-tls-ca", ca, "--transfer-tls-cert", cert,
                                              "--transfer-tls-key", key))
                 if s.role in SIDE_CHANNEL_ROLES else s for s in specs]
    if config.nats_creds_dir is None:
        return specs
    return [dataclasses.replace(s, args=(*s.args, "--nats-creds", str(creds_path(config.nats_creds_dir, s.instance_id))))
            for s in specs]


def pipelines_of(specs: list[ServiceSpec]) -> tuple[Pipeline, ...]:
    """The pipelines the planned services form: each head (a stage given `--stages`) and its stages in order."""
    return tuple(Pipeline(s.instance_id, tuple(s.args[s.args.index("--stages") + 1].split(",")))
                 for s in specs if s.role == "stage" and "--stages" in s.args)


def device_of(config: UpConfig, spec: ServiceSpec) -> str:
    """A model worker's device: its pool's (a prefill pipeline's stages are the prefill pool's), else `device`."""
    pool = "prefill" if spec.role == "prefill" or spec.name.startswith("prefill") else "decode"
    return (config.prefill_device if pool == "prefill" else config.decode_device) or config.device


def check_devices(topology: str, device: str, prefill_device: str | None, decode_device: str | None,
                  gpu_memory_utilization: float | None, cuda_devices: int, pipelined: bool = False) -> None:
    """ValueError unless every pool's device exists here (`cuda_devices` of them) and a GPU memory share has a
    GPU to apply to (and whole-model workers: `pipelined`, some of the workers are pipeline stages)."""
    if prefill_device is not None and topology != "disagg":
        raise ValueError(f"--prefill-device is the prefill pool's; --topology {topology} has none (use --device)")
    used = {decode_device or device} | ({prefill_device or device} if topology == "disagg" else set())
    for name in sorted(used - {"cpu"}):
        index = int(name.partition(":")[2] or 0)
        if index >= cuda_devices:
            raise ValueError(f"device {name} is not here: torch sees {cuda_devices} CUDA device(s)")
    if gpu_memory_utilization is not None and pipelined:
        raise ValueError("--gpu-memory-utilization sizes whole-model workers' KV caches; pipeline stages take "
                         "theirs from the engine's fixed size")
    if gpu_memory_utilization is not None and "cpu" in used:
        raise ValueError("--gpu-memory-utilization shares out a GPU's memory; a model worker here runs on the CPU "
                         "(give --device cuda, or the pool's --prefill-device/--decode-device)")


def _device_flags(config: UpConfig, spec: ServiceSpec) -> tuple[str, ...]:
    device = device_of(config, spec)
    flags = () if device == "cpu" else ("--device", device)
    if config.gpu_memory_utilization is not None:
        flags += ("--gpu-memory-utilization", f"{config.gpu_memory_utilization:g}")
    return flags


def _with_cpu_loans(specs: list[ServiceSpec], shares: dict[str, tuple[int, ...]], loan_dir: str) -> list[ServiceSpec]:
    """Each paired prefill worker lends its CPUs through a loan file to its decode worker (`pair_cpu_loans`)."""
    role = {s.name: s.role for s in specs}
    pairs = pair_cpu_loans([n for n in role if role[n] == "prefill"], [n for n in role if role[n] == "decode"], shares)
    extra: dict[str, tuple[str, ...]] = {}
    for lender, borrower in pairs:
        loan = f"{loan_dir}/{lender}.loan"
        extra[lender] = ("--cpu-loan", loan)
        extra[borrower] = ("--cpu-loan", loan, "--borrow-cpus", format_cpu_list(shares[lender]))
    return [dataclasses.replace(s, args=(*s.args, *extra[s.name])) if s.name in extra else s for s in specs]


def _plan(config: UpConfig) -> list[ServiceSpec]:
    if config.topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {config.topology!r} (choose from {', '.join(TOPOLOGIES)})")
    if config.decode < 1:
        raise ValueError("--decode must be at least 1")
    disagg = config.topology == "disagg"
    if disagg and config.prefill < 1:
        raise ValueError("--prefill must be at least 1")
    bus = ("--nats", config.nats_url, "--namespace", config.namespace)
    model = ("--model", config.model, "--served-model-name", config.served_model_name)
    if config.topology == "pipeline":
        if config.kv_store:
            raise ValueError("the kv-store needs workers holding every layer; --topology pipeline cannot use it")
        return _plan_pipeline(config, bus, model)
    kv_store = uses_kv_store(config)
    scheduler_args = (*bus, "--instance-id", "scheduler-0", "--router", config.router)
    if disagg and config.max_local_prefill is not None:
        scheduler_args += ("--max-local-prefill", str(config.max_local_prefill))
    if disagg and not config.offload_short_prefills:
        scheduler_args += ("--no-offload-short-prefills",)
    if disagg and config.prefill_backlog_factor is not None:
        scheduler_args += ("--prefill-backlog-factor", f"{config.prefill_backlog_factor:g}")
    specs = [ServiceSpec("scheduler-0", "scheduler", "scheduler-0", scheduler_args)]
    counts = {"decode": config.decode, "scheduler": 1}
    store_flag = ("--kv-store",) if kv_store else ()
    if kv_store:
        specs.append(_kvstore(config, bus))
        counts["kvstore"] = 1
    if disagg and config.stage_ranges:
        specs += _prefill_pipeline(config, bus, model)
        counts.update(prefill=1, stage=len(config.stage_ranges) - 1)
    elif disagg:
        counts["prefill"] = config.prefill
        for i in range(config.prefill):
            iid = f"prefill-{i}"
            specs.append(ServiceSpec(iid, "prefill", iid, (*bus, *model, "--instance-id", iid, *_engine_flags(config),
                                                           "--kv-transport", config.kv_transport, *store_flag)))
    for i in range(config.decode):
        iid = f"decode-{i}"
        specs.append(
            ServiceSpec(
                iid, "decode", iid,
                (*bus, *model, "--mode", "disagg" if disagg else "colocated", "--instance-id", iid,
                 *_engine_flags(config), *store_flag, *_pacing_flags(config), *_drain_flags(config)),
            )
        )
    specs.append(_gateway(config, bus, model, counts))
    return specs


def uses_kv_store(config: UpConfig) -> bool:
    """Whether the deployment runs a kv-store: as asked, else by default in disagg."""
    return config.kv_store if config.kv_store is not None else config.topology == "disagg"


def _gateway(config: UpConfig, bus: tuple, model: tuple, counts: dict[str, int]) -> ServiceSpec:
    args = (*bus, *model, "--host", config.host, "--port", str(config.port), "--expect", expect_arg(counts),
            "--instance-id", "gateway-0")
    if config.migration_limit is not None:
        args += ("--migration-limit", str(config.migration_limit))
    if config.max_waiting_requests is not None:
        args += ("--max-waiting-requests", str(config.max_waiting_requests))
    if config.chat_template is not None:
        args += ("--chat-template", config.chat_template)
    if config.share_prefix_cache:
        args += ("--share-prefix-cache",)
    if config.protect_metrics:
        args += ("--protect-metrics",)
    args += _drain_flags(config)
    return ServiceSpec("gateway-0", "gateway", "gateway-0", args, url=http_url(config.host, config.port))


def _drain_flags(config: UpConfig) -> tuple[str, ...]:
    return () if config.drain_timeout_s is None else ("--drain-timeout", f"{config.drain_timeout_s:g}")


def _plan_pipeline(config: UpConfig, bus: tuple, model: tuple) -> list[ServiceSpec]:
    """One pipeline: stage-1.. first (the head waits for them), then the head stage-0, which takes requests."""
    if len(config.stage_ranges) < 2:
        raise ValueError("a pipeline needs at least 2 stages")
    if config.decode != 1:
        raise ValueError("--topology pipeline runs one pipeline; --decode must be 1")
    if config.microbatches < 1:
        raise ValueError("--microbatches must be at least 1")
    specs = [ServiceSpec("scheduler-0", "scheduler", "scheduler-0",
                         (*bus, "--instance-id", "scheduler-0", "--router", config.router))]
    stages = [f"stage-{i}" for i in range(1, len(config.stage_ranges))]
    for iid, (start, end) in zip(stages, config.stage_ranges[1:]):
        specs.append(ServiceSpec(iid, "stage", iid, (*bus, *model, "--instance-id", iid, *_engine_flags(config),
                                                     "--layers", f"{start}:{end}")))
    start, end = config.stage_ranges[0]
    specs.append(ServiceSpec("stage-0", "stage", "stage-0", (
        *bus, *model, "--instance-id", "stage-0", *_engine_flags(config), "--layers", f"{start}:{end}",
        "--stages", ",".join(stages), "--microbatches", str(config.microbatches))))
    specs.append(_gateway(config, bus, model, {"decode": 1, "scheduler": 1, "stage": len(stages)}))
    return specs


def _prefill_pipeline(config: UpConfig, bus: tuple, model: tuple) -> list[ServiceSpec]:
    """disagg with a pipelined prefill pool: prefill-stage-1.. (each ships its own layers' KV), then the head
    prefill-0, which pulls the prefill jobs."""
    if len(config.stage_ranges) < 2:
        raise ValueError("a prefill pipeline needs at least 2 stages")
    if config.prefill != 1:
        raise ValueError("--prefill-stages runs one prefill pipeline; --prefill must be 1")
    stages = [f"prefill-stage-{i}" for i in range(1, len(config.stage_ranges))]
    ships = ("--ships-kv", "--kv-transport", config.kv_transport)
    specs = []
    for iid, (start, end) in zip(stages, config.stage_ranges[1:]):
        specs.append(ServiceSpec(iid, "stage", iid, (*bus, *model, "--instance-id", iid, *_engine_flags(config),
                                                     "--layers", f"{start}:{end}", *ships)))
    start, end = config.stage_ranges[0]
    specs.append(ServiceSpec("prefill-0", "stage", "prefill-0", (
        *bus, *model, "--instance-id", "prefill-0", *_engine_flags(config), "--layers", f"{start}:{end}",
        "--stages", ",".join(stages), "--microbatches", str(config.microbatches), "--head-role", "prefill",
        "--kv-transport", config.kv_transport)))
    return specs


def _kvstore(config: UpConfig, bus: tuple) -> ServiceSpec:
    args = (*bus, "--instance-id", "kvstore-0", "--kv-store-ram-bytes", str(config.kv_store_ram_bytes))
    if config.kv_store_disk_bytes:
        if not config.kv_store_dir:
            raise ValueError("a kv-store disk tier needs a directory")
        args += ("--kv-store-disk-bytes", str(config.kv_store_disk_bytes), "--kv-store-dir", config.kv_store_dir)
    return ServiceSpec("kvstore-0", "kvstore", "kvstore-0", args)

