"""Which services a topology runs, each with its settings object.

Pure: no processes, no I/O. `plan()` builds each planned service's settings (`DecodeSettings(...)`, ...) from `up`'s
settings and what `up` resolved at start (`ResolvedRun`); `to_flags` renders them into its command line, which the
service's own parser reads back into an equal object (tests/launcher/test_topology.py checks every one).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from services.common.cpus import pair_cpu_loans, share_cpus
from services.common.service_settings import EngineSettings
from services.common.settings import Settings, default_of, to_flags
from services.decode.settings import DecodeSettings
from services.gateway.settings import GatewayServiceSettings
from services.kvstore.settings import KVStoreSettings
from services.launcher.nats_auth import Instance, creds_path
from services.launcher.resolved_run import ResolvedRun
from services.launcher.served_models import FurtherModel
from services.launcher.up_settings import DISAGG_PREFILL_BESIDE_DECODES_MS, UpSettings
from services.prefill.settings import PrefillSettings
from services.scheduler.settings import SchedulerSettings
from services.stage.settings import StageSettings
from shared.bus.permissions import Pipeline


@dataclass(frozen=True)
class ServiceSpec:
    """One service process: `python -m services.ROLE ARGS...`, ARGS rendered from its settings."""

    name: str  # unique in the deployment; also the log file's name
    settings: Settings  # the service's own settings class (its ROLE names the service)
    url: str | None = None  # what it serves, for `ps`

    @property
    def role(self) -> str:
        return type(self.settings).ROLE

    @property
    def instance_id(self) -> str:
        return self.settings.instance_id

    @property
    def args(self) -> tuple[str, ...]:
        return tuple(to_flags(self.settings))

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def module(self) -> str:
        return f"services.{self.role}"

    def argv(self, python: str | None = None) -> list[str]:
        return [python or sys.executable, "-m", self.module, *self.args]


@dataclass(frozen=True)
class _Draft:
    """A planned service whose settings are still being gathered."""

    name: str
    kind: type[Settings]
    given: dict[str, Any]
    url: str | None = None
    prefix: str = ""  # its model's (`FurtherModel.prefix`), which `name` begins with


def _given(**values: Any) -> dict[str, Any]:
    """The values that say something: None leaves the service its own default."""
    return {name: value for name, value in values.items() if value is not None}


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


ENGINE_ROLES = ("decode", "prefill", "stage")
SIDE_CHANNEL_ROLES = (*ENGINE_ROLES, "kvstore")  # the services that move KV or activations outside NATS


def decode_pacing_ms(up: UpSettings) -> float | None:
    """The decode workers' `--prefill-beside-decodes-ms` (None: not paced)."""
    ms = up.prefill_beside_decodes_ms
    if ms is None:
        ms = DISAGG_PREFILL_BESIDE_DECODES_MS if up.topology == "disagg" else 0.0
    return ms or None


def plan(up: UpSettings, run: ResolvedRun, further: tuple[FurtherModel, ...] = ()) -> list[ServiceSpec]:
    """The services of the deployment, in start order (the gateway last), each with its settings: the first
    model's in up's namespace, each further model's in its own under its prefix; model workers each on their own
    CPUs (the models without a CPU list of their own share up's out together)."""
    first, counts = _pools(up, run)
    models = [(up, run, first)]
    for model in further:
        model_up, model_run = model.up, run_of(run, model)
        models.append((model_up, model_run, _prefixed(_pools(model_up, model_run)[0], model.prefix)))
    shares = _shares([(r.cpus, drafts) for _, r, drafts in models])
    specs = [spec for u, r, drafts in models for spec in _specs(_with_cpus(drafts, u, r, shares), u, r)]
    return [*specs, *_specs([_gateway(up, run, counts, further)], up, run)]


def model_services(run: ResolvedRun, model: FurtherModel) -> list[ServiceSpec]:
    """One further model's services alone (served at runtime: `splitserve models serve`), its workers' CPUs
    shared out among themselves (the launcher places them among the running ones)."""
    model_run = run_of(run, model)
    drafts = _prefixed(_pools(model.up, model_run)[0], model.prefix)
    return _specs(_with_cpus(drafts, model.up, model_run, _shares([(model_run.cpus, drafts)])), model.up, model_run)


def run_of(run: ResolvedRun, model: FurtherModel) -> ResolvedRun:
    """What a further model's services are planned from: the deployment's bus, its own model, CPUs and stages."""
    return dataclasses.replace(
        run, model_dir=model.model_dir, served_model_name=model.served_name, stage_ranges=model.stage_ranges,
        cpus=run.cpus if model.cpus is None else model.cpus, chat_template=None,
        kv_store_dir=f"{run.kv_store_dir}-{model.prefix.rstrip('-')}" if run.kv_store_dir else None)


def expected_counts(up: UpSettings, run: ResolvedRun) -> dict[str, int]:
    """How many services of each role one model's pools register ready (what the gateway expects of the first)."""
    return _pools(up, run)[1]


def _pools(up: UpSettings, run: ResolvedRun) -> tuple[list[_Draft], dict[str, int]]:
    """One model's services (its scheduler, kv-store, workers) and their counts by role (what the gateway
    expects)."""
    return _plan_pipeline(up, run) if up.topology == "pipeline" else _plan_pools(up, run)


def _specs(drafts: list[_Draft], up: UpSettings, run: ResolvedRun) -> list[ServiceSpec]:
    return [ServiceSpec(d.name, d.kind(**d.given, **_everyone(up, run, d)), d.url) for d in drafts]


def _prefixed(drafts: list[_Draft], prefix: str) -> list[_Draft]:
    """A further model's services under its prefix (a pipeline head's stages too)."""
    renamed = []
    for d in drafts:
        given = dict(d.given)
        if given.get("stages"):
            given["stages"] = [prefix + name for name in given["stages"]]
        renamed.append(dataclasses.replace(d, name=prefix + d.name, given=given, prefix=prefix))
    return renamed


def instances_of(specs: list[ServiceSpec]) -> list[Instance]:
    """The planned services' NATS identities, each in its model's namespace; the gateway's in every model's."""
    return [instance_of(s, tuple(dict.fromkeys(spec.namespace for spec in specs))) for s in specs]


def instance_of(spec: ServiceSpec, served_namespaces: tuple[str, ...]) -> Instance:
    """One service's NATS identity: the gateway's spans `served_namespaces`, its own first."""
    if spec.role == "gateway":
        return Instance(spec.role, spec.instance_id, tuple(dict.fromkeys((spec.namespace, *served_namespaces))))
    return Instance(spec.role, spec.instance_id, (spec.namespace,))


def _everyone(up: UpSettings, run: ResolvedRun, draft: _Draft) -> dict[str, Any]:
    """What every service is told alike: its bus, and (by role) the side channel's TLS and its device."""
    given = _given(nats=run.nats_url, namespace=up.namespace, instance_id=draft.name, nats_tls_ca=run.nats_tls_ca,
                   nats_replicas=run.nats_replicas,
                   nats_creds=str(creds_path(run.nats_creds_dir, draft.name)) if run.nats_creds_dir else None)
    role = draft.kind.ROLE
    if run.transfer_tls is not None and role in SIDE_CHANNEL_ROLES:
        given.update(zip(("transfer_tls_ca", "transfer_tls_cert", "transfer_tls_key"), run.transfer_tls))
    if role in ENGINE_ROLES:
        device = device_of(up, draft.name.removeprefix(draft.prefix), role)
        given |= _given(device=None if device == default_of(EngineSettings, "device") else device,  # theirs unsaid
                        gpu_memory_utilization=up.gpu_memory_utilization)
    return given


def pipelines_of(specs: list[ServiceSpec]) -> tuple[Pipeline, ...]:
    """The pipelines the planned services form: each head (a stage given `stages`) and its stages in order."""
    return tuple(Pipeline(s.instance_id, stages_of(s)) for s in specs if stages_of(s))


def device_of(up: UpSettings, name: str, role: str) -> str:
    """A model worker's device: its pool's (a prefill pipeline's stages are the prefill pool's), else `device`."""
    pool = "prefill" if role == "prefill" or name.startswith("prefill") else "decode"
    return (up.prefill_device if pool == "prefill" else up.decode_device) or up.device


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


PLACED_ROLES = ("decode", "prefill")  # the workers that follow a placement file (a stage after the head cannot)


def placement_file(directory: str, name: str) -> str:
    """Worker `name`'s placement file (its --cpus-file)."""
    return f"{directory}/{name}.cpus"


def _shares(models: list[tuple[tuple[int, ...], list[_Draft]]]) -> dict[str, tuple[int, ...]]:
    """Each model worker's share of its model's CPUs (`models`: each model's CPUs and services): the models on
    one list of CPUs share it out together, each worker its own part where there are enough."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for cpus, drafts in models:
        groups.setdefault(cpus, []).extend(d.name for d in drafts if d.kind.ROLE in ENGINE_ROLES)
    return {name: share for cpus, names in groups.items() for name, share in share_cpus(names, cpus).items()}


def _with_cpus(drafts: list[_Draft], up: UpSettings, run: ResolvedRun,
               shared: dict[str, tuple[int, ...]]) -> list[_Draft]:
    """Each model worker its share of the CPUs (`shared`, the whole deployment's: `_shares`); in disagg each
    paired prefill worker lends its CPUs through a loan file to its decode worker (`pair_cpu_loans`)."""
    role = {d.name: d.kind.ROLE for d in drafts}
    shares = {name: cpus for name, cpus in shared.items() if name in role}
    extra: dict[str, dict[str, Any]] = {name: {"cpus": cpus} for name, cpus in shares.items()}
    if run.cpu_loan_dir is not None and up.topology == "disagg":
        pairs = pair_cpu_loans([n for n in role if role[n] == "prefill"], [n for n in role if role[n] == "decode"],
                               shared)
        for lender, borrower in pairs:
            loan = f"{run.cpu_loan_dir}/{lender}.loan"
            extra[lender]["cpu_loan"] = loan
            extra[borrower] |= {"cpu_loan": loan, "borrow_cpus": shares[lender]}
    if run.cpu_placement_dir is not None:  # the launcher moves them at runtime (a scale) through this file
        for name in shares:
            if role[name] in PLACED_ROLES:
                extra[name]["cpus_file"] = placement_file(run.cpu_placement_dir, name)
    return [_Draft(d.name, d.kind, {**d.given, **extra.get(d.name, {})}, d.url) for d in drafts]


def _model(run: ResolvedRun) -> dict[str, Any]:
    return {"model": run.model_dir, "served_model_name": run.served_model_name}


def _engine(up: UpSettings, run: ResolvedRun) -> dict[str, Any]:
    """The settings every model worker (decode, prefill, stage) gets alike."""
    return _model(run) | _given(dtype=up.dtype, max_num_batched_tokens=up.max_num_batched_tokens,
                                scheduling_policy=up.scheduling_policy)


def _scheduler(up: UpSettings) -> _Draft:
    given: dict[str, Any] = {"router": up.router}
    if up.topology == "disagg":
        given |= _given(max_local_prefill=up.max_local_prefill, offload_short_prefills=up.offload_short_prefills,
                        prefill_backlog_factor=up.prefill_backlog_factor)
    return _Draft("scheduler-0", SchedulerSettings, given)


def _plan_pools(up: UpSettings, run: ResolvedRun) -> tuple[list[_Draft], dict[str, int]]:
    """colocated or disagg: a scheduler, maybe a kv-store, the prefill pool (disagg), the decode pool."""
    disagg = up.topology == "disagg"
    kv_store = up.runs_kv_store
    drafts = [_scheduler(up)]
    counts = {"decode": up.decode, "scheduler": 1}
    if kv_store:
        drafts += [_kvstore(up, run, i) for i in range(up.kv_stores)]
        counts["kvstore"] = up.kv_stores
    if disagg and run.stage_ranges:
        drafts += _prefill_pipeline(up, run)
        counts.update(prefill=1, stage=len(run.stage_ranges) - 1)
    elif disagg:
        counts["prefill"] = up.prefill
        drafts += [_Draft(f"prefill-{i}", PrefillSettings, {**_engine(up, run), "kv_transport": up.kv_transport,
                                                            **_given(kv_store=kv_store or None,
                                                                     role_switch=up.role_switch or None)})
                   for i in range(up.prefill)]
    decode = {**_engine(up, run), "mode": "disagg" if disagg else "colocated",
              **_given(kv_store=kv_store or None, prefill_beside_decodes_ms=decode_pacing_ms(up),
                       drain_timeout=run.drain_timeout, role_switch=(disagg and up.role_switch) or None)}
    drafts += [_Draft(f"decode-{i}", DecodeSettings, decode) for i in range(up.decode)]
    return drafts, counts


def also_serve(models: tuple[FurtherModel, ...]) -> list[str]:
    """The gateway's `--also-serve NAME=MODEL@NAMESPACE` values: every further model (NAME is split off at the
    first '=', NAMESPACE at the last '@')."""
    return [f"{m.served_name}={m.model_dir}@{m.namespace}" for m in models]


def _gateway(up: UpSettings, run: ResolvedRun, counts: dict[str, int], further: tuple[FurtherModel, ...]) -> _Draft:
    given = {**_model(run), "host": up.host, "port": up.port, "expect": counts, "api_keys": up.api_keys,
             **_given(migration_limit=up.migration_limit, max_waiting_requests=up.max_waiting_requests,
                      keys_file=up.keys_file, max_dispatched=up.max_dispatched,
                      chat_template=run.chat_template, drain_timeout=run.drain_timeout,
                      share_prefix_cache=up.share_prefix_cache or None, protect_metrics=up.protect_metrics or None)}
    if further:
        given["also_serve"] = also_serve(further)
    return _Draft("gateway-0", GatewayServiceSettings, given, url=http_url(up.host, up.port))


def _stages(up: UpSettings, run: ResolvedRun, prefix: str, replica: int = 0, **each: Any) -> list[_Draft]:
    """A pipeline's stages after the head, PREFIX1.., each its layers."""
    return [_Draft(pipeline_name(f"{prefix}{i}", replica), StageSettings,
                   {**_engine(up, run), "layers": f"{start}:{end}", **each})
            for i, (start, end) in enumerate(run.stage_ranges[1:], start=1)]


def _head(up: UpSettings, run: ResolvedRun, name: str, stages: list[_Draft], **given: Any) -> _Draft:
    start, end = run.stage_ranges[0]
    return _Draft(name, StageSettings, {**_engine(up, run), "layers": f"{start}:{end}",
                                        "stages": [s.name for s in stages], "microbatches": up.microbatches,
                                        **given})


def _plan_pipeline(up: UpSettings, run: ResolvedRun) -> tuple[list[_Draft], dict[str, int]]:
    """--decode pipelines, each its stages first (the head waits for them), then its head, which takes requests
    as a decode worker: stage-1.., stage-0, then the further pipelines' (`pipeline_name`)."""
    if up.kv_store:
        raise ValueError("the kv-store needs workers holding every layer; --topology pipeline cannot use it")
    if len(run.stage_ranges) < 2:
        raise ValueError("a pipeline needs at least 2 stages")
    drafts = [_scheduler(up)]
    for replica in range(up.decode):
        stages = _stages(up, run, "stage-", replica=replica)
        drafts += [*stages, _head(up, run, pipeline_name("stage-0", replica), stages,
                                  **_given(drain_timeout=run.drain_timeout))]
    return drafts, {"decode": up.decode, "scheduler": 1, "stage": up.decode * (len(run.stage_ranges) - 1)}


def pipeline_name(name: str, replica: int) -> str:
    """A pipeline service's name in pipeline `replica`: the first pipeline's as it is, a further one's with
    -pR (stage-1 of the third pipeline: stage-1-p2)."""
    return name if replica == 0 else f"{name}-p{replica}"


def stages_of(spec: ServiceSpec) -> tuple[str, ...]:
    """A pipeline head's stages after it, in order; none for any other service."""
    return tuple(spec.settings.stages or ()) if spec.role == "stage" else ()


def pool_of(spec: ServiceSpec) -> str:
    """The pool a service is counted in: a pipeline's head in its head role's (it takes that pool's work), a
    stage after a head in "stage" (it goes with its head), any other service in its role's."""
    return spec.settings.head_role if stages_of(spec) else spec.role


def _prefill_pipeline(up: UpSettings, run: ResolvedRun) -> list[_Draft]:
    """disagg with a pipelined prefill pool: prefill-stage-1.. (each ships its own layers' KV), then the head
    prefill-0, which pulls the prefill jobs."""
    if len(run.stage_ranges) < 2:
        raise ValueError("a prefill pipeline needs at least 2 stages")
    if up.prefill != 1:
        raise ValueError("--prefill-stages runs one prefill pipeline; --prefill must be 1")
    stages = _stages(up, run, "prefill-stage-", ships_kv=True, kv_transport=up.kv_transport)
    return [*stages, _head(up, run, "prefill-0", stages, head_role="prefill", kv_transport=up.kv_transport)]


def _kvstore(up: UpSettings, run: ResolvedRun, index: int) -> _Draft:
    """kv-store `index`, its RAM tier and its disk tier (a directory of its own) as up's settings say."""
    given: dict[str, Any] = {"kv_store_ram_bytes": up.kv_store_ram_bytes}
    if up.kv_store_disk_bytes:
        if not run.kv_store_dir:
            raise ValueError("a kv-store disk tier needs a directory")
        directory = run.kv_store_dir if index == 0 else f"{run.kv_store_dir}-{index}"
        given |= {"kv_store_disk_bytes": up.kv_store_disk_bytes, "kv_store_dir": directory}
    return _Draft(f"kvstore-{index}", KVStoreSettings, given)
