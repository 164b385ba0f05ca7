"""`splitserve up`'s settings: each one's type, default and description, from which its flag, its SPLITSERVE_*
variable and its key in `up --config FILE` come (`services.common.settings`). A setting `up` passes on to a service
takes its default from that service's settings (`default_of`), so each default is written once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from services.common.service_settings import (
    ApiKeys,
    ApiKeysFile,
    BusSettings,
    Count,
    Device,
    Dtype,
    EngineSettings,
    MemoryShare,
    ModelSettings,
    Port,
    PositiveInt,
    PositiveSeconds,
    SchedulingPolicy,
    Transport,
)
from services.common.settings import Settings, default_of, option, shown_default_of
from services.gateway.settings import GatewayServiceSettings as Gateway
from services.kvstore.settings import KVStoreSettings
from services.launcher.deployment import DEFAULT_RUN_DIR
from services.launcher.log_files import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from services.launcher.model_spec import ModelSpec, Topology, UsableCpus, model_specs
from services.decode.settings import DecodeSettings
from services.planner.settings import PlannerSettings, PositiveMs
from services.prefill.settings import PrefillSettings
from services.scheduler.settings import RouterKind, SchedulerSettings
from shared.engine import DEFAULT_MICROBATCHES, DEFAULT_MODEL

# In disagg a decode worker still prefills short prompts (and long ones when no prefill worker can); pacing
# those chunks keeps its running requests' tokens flowing. On a 2-core CPU, the mixed load (short-request ITL
# p99, one run each): float32 200 ms: 246 ms, 130 ms: 164 ms; bfloat16 200 ms: 210 ms, 130 ms: 136 ms; no
# cost in tokens/s at concurrency 16 nor in the mixed wall time (within this machine's drift).
DISAGG_PREFILL_BESIDE_DECODES_MS = 130.0


class UpSettings(Settings):
    """The whole deployment on this machine."""

    @property
    def first_model(self) -> str | None:
        """The first --model (None: the default model), which takes up's own settings."""
        return self.models[0].model if self.models else None

    @property
    def further_models(self) -> tuple[ModelSpec, ...]:
        """Every later --model, each with its own keys."""
        return self.models[1:]

    @property
    def runs_kv_store(self) -> bool:
        """Whether the deployment runs a kv-store: as asked, else by default in disagg."""
        return self.kv_store if self.kv_store is not None else self.topology == "disagg"

    # The model and the API.
    models: Annotated[tuple[ModelSpec, ...], BeforeValidator(model_specs)] = option(
        (), "the model: a known model's name (`splitserve models list`; fetched into the cache on first use), a "
        "Hugging Face model directory or a .gguf file, converted once into the cache. Repeatable: every later one is "
        "served beside the first, in a namespace of its own, with its own keys (name, dtype, topology, decode, "
        "prefill, stages, kv_store, kv_stores, cpus; each defaulting to up's), e.g. `--model B:name=b,decode=2` (the "
        "variable: MODEL;MODEL:KEY=VALUE,...; the file: `models: [{model: A}, {model: B, name: b}]`; "
        "docs/models.md)", flag="--model", metavar="MODEL[:KEY=VALUE,...]", many=True, separator=";",
        shown_default=DEFAULT_MODEL)
    served_model_name: str | None = option(None, "the model name clients ask for (default: a known model's name, "
                                           "else the directory's or file's name)", metavar="NAME")
    dtype: Dtype = option(default_of(ModelSettings, "dtype"), "model weights' dtype")
    host: str = option(default_of(Gateway, "host"), "address the gateway listens on")
    port: Port = option(default_of(Gateway, "port"), "port the gateway listens on")
    api_keys: ApiKeys = option((), "the gateway requires `Authorization: Bearer KEY` on /v1/* (repeatable; "
                                       "KEY:TENANT names its tenant; the variable takes KEY,KEY,..., which other "
                                       "local users cannot read as they can a flag; the keys of both count)",
                                       flag="--api-key", metavar="KEY[:TENANT]", env="SPLITSERVE_API_KEY", many=True,
                                       joined=True, repr=False)
    keys_file: ApiKeysFile = option(None, "the gateway's API keys and their tenants' limits, YAML or JSON "
                                        "(docs/security.md; only its owner may read it)", flag="--api-keys-file",
                                        metavar="FILE")
    share_prefix_cache: bool = option(
        default_of(Gateway, "share_prefix_cache"), "requests of different tenants reuse each other's cached prompt "
        "prefixes (by default each tenant's are its own)")
    protect_metrics: bool = option(default_of(Gateway, "protect_metrics"),
                                   "with --api-key, the gateway's /metrics requires a key too")
    chat_template: str | None = option(None, "the gateway's chat template instead of the tokenizer's: a Jinja "
                                       "file, or the template itself", metavar="FILE|TEMPLATE")
    migration_limit: Count | None = option(None, "times a request moves to another worker, from the tokens its "
                                           "client has, when its worker fails under it (0: it fails instead)",
                                           metavar="N",
                                           shown_default=f"the gateway's, {default_of(Gateway, 'migration_limit')}")
    max_waiting_requests: Count | None = option(None, "admission control: with N requests still waiting for their "
                                                "first token, a new one gets 429 and Retry-After (0: no bound)",
                                                metavar="N", shown_default="the gateway's, "
                                                f"{default_of(Gateway, 'max_waiting_requests')}")
    max_dispatched: Count | None = option(None, "fair admission: requests sent on to the workers without a first "
                                          "token yet, at most, but for a tenant under its share of them; the others "
                                          "wait at the gateway, per tenant, in turn (0: no bound, first come first "
                                          "served)", metavar="N",
                                          shown_default=f"the gateway's, {default_of(Gateway, 'max_dispatched')}")

    # How inference is split.
    topology: Topology = option(
        "disagg", "how inference is split: colocated workers, separate prefill and decode pools, or the model's "
        "layers over pipeline stages (default: disagg, one prefill and one decode worker)")
    decode: PositiveInt = option(1, "number of decode workers (--topology pipeline: of pipelines)", metavar="N")
    prefill: PositiveInt = option(1, "number of prefill workers with --topology disagg", metavar="N")
    max_local_prefill: Count | None = option(None, "disagg: prompts with more uncached tokens than N are prefilled "
                                             "remotely (0: always)", metavar="N",
                                             shown_default="the scheduler's, "
                                             f"{default_of(SchedulerSettings, 'max_local_prefill')}")
    offload_short_prefills: bool = option(
        default_of(SchedulerSettings, "offload_short_prefills"), "disagg: a shorter prompt goes to an idle prefill "
        "worker too while its decode worker is busy streaming")
    prefill_backlog_factor: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = option(
        None, "disagg: a long prompt is prefilled by its decode worker when each prefill worker has more than F "
        "times its tokens queued (e.g. 0.5; 0: never)", metavar="F",
        shown_default=f"the scheduler's, {default_of(SchedulerSettings, 'prefill_backlog_factor'):g}")
    lend_idle_cpus: bool = option(True, "disagg: while a prefill worker has nothing to compute, its CPUs run its "
                                  "decode worker's steps too, handed back before each prefill")
    role_switch: bool = option(default_of(DecodeSettings, "role_switch"), "disagg: the operator may switch a "
                               "decode worker to prefill and back (`splitserve switch ID ROLE`), on its loaded "
                               "engine; each decode and prefill worker's bus key then holds both roles")
    kv_transport: Transport = option(default_of(PrefillSettings, "kv_transport"),
                                     "disagg: how KV moves from prefill to decode workers")
    stages: PositiveInt | None = option(None, "pipeline: split the layers evenly over N stage processes",
                                        metavar="N", shown_default="2")
    layer_split: str | None = option(None, "pipeline: each stage's layers, e.g. 0:6,6:12 (instead of --stages)",
                                     metavar="A:B,B:C,...")
    prefill_stages: PositiveInt | None = option(None, "disagg: the prefill pool is one pipeline of N stages, each "
                                                "shipping its own layers' KV to the decode workers (with --prefill 1)",
                                                metavar="N")
    microbatches: PositiveInt = option(DEFAULT_MICROBATCHES, "pipeline: steps in flight through the stages at once",
                                       metavar="M")
    max_num_batched_tokens: PositiveInt | None = option(None, "every worker's token budget per step: long prompts "
                                                        "are prefilled in chunks of at most N tokens, mixed with "
                                                        "decodes", metavar="N", shown_default="the engine's, "
                                                        f"{default_of(EngineSettings, 'max_num_batched_tokens')}")
    scheduling_policy: SchedulingPolicy | None = option(
        None, "every worker's: fair (its batch shared between tenants, by priority and places held) or fcfs (first "
        "come first served)", shown_default=f"the engine's, {default_of(EngineSettings, 'scheduling_policy')}")
    prefill_beside_decodes_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = option(
        None, "decode workers' stall-free chunking: a step carrying decodes lasts about MS, with the prompt chunks "
        "that fit beside them, so a prompt prefilled on a decode worker never stalls the others' tokens (0: off)",
        metavar="MS", shown_default=f"{DISAGG_PREFILL_BESIDE_DECODES_MS:g} in disagg, off in colocated")
    device: Device = option(default_of(EngineSettings, "device"), "every model worker's device: cpu, cuda or cuda:N")
    prefill_device: Device | None = option(None, "disagg: the prefill pool's device (e.g. cuda:0, with "
                                           "--decode-device cuda:1)", shown_default="--device")
    decode_device: Device | None = option(None, "the decode pool's device (a colocated or pipeline deployment's "
                                          "workers too)", shown_default="--device")
    gpu_memory_utilization: MemoryShare | None = option(
        None, "on GPUs: the share of its GPU's memory each model worker may use (vLLM's meaning; workers sharing a "
        "GPU each take this share); its KV cache takes what its weights and a full step leave", metavar="F",
        shown_default="none: each worker's KV cache is the engine's fixed size")
    cpus: UsableCpus = option(
        "auto", "CPUs the model workers share out, each its own contiguous part, one torch thread per CPU (auto: "
        "every CPU this process may use; none: the OS places them)", metavar="auto|none|LIST")

    # The SLO planner.
    planner: Literal["none", "slo"] = option("none", "slo: run the SLO planner, which moves workers between the "
                                             "prefill and decode pools (within --planner-budget) to keep TTFT and "
                                             "ITL p90 within --ttft-slo-ms and --itl-slo-ms")
    ttft_slo_ms: PositiveMs | None = option(None, "--planner slo: time to first token, p90, to keep under",
                                            metavar="MS", shown_default="none, required with --planner slo")
    itl_slo_ms: PositiveMs | None = option(None, "--planner slo: time between tokens, p90, to keep under",
                                           metavar="MS", shown_default="none, required with --planner slo")
    planner_budget: PositiveInt | None = option(
        None, "--planner slo: workers the prefill and decode pools may hold together", metavar="N",
        shown_default="on CPUs, one per CPU the workers are placed on; on GPUs, each GPU's 1 / "
        "--gpu-memory-utilization workers (without it, the workers `up` starts); never fewer than those")
    planner_dry_run: bool = option(default_of(PlannerSettings, "dry_run"), "--planner slo: the planner logs and "
                                   "counts what it would do, and changes nothing")
    planner_interval_s: PositiveSeconds = option(default_of(PlannerSettings, "interval_s"), "--planner slo: "
                                                 "seconds between the planner's evaluations", metavar="S")

    # The KV store and routing.
    kv_store: bool | None = option(None, "run a kv-store: workers load cached prompt prefixes from it and write "
                                   "computed blocks back, so a prefix is computed once for all workers (default: on "
                                   "with disagg; --no-kv-store turns it off)")
    kv_stores: PositiveInt = option(1, "kv-store instances: each holds the blocks rendezvous hashing gives it "
                                    "(`splitserve scale kvstore=N` changes it at runtime)", metavar="N")
    router: RouterKind = option(
        default_of(SchedulerSettings, "router"), "how the scheduler picks a worker: kv scores the prompt prefix each "
        "worker's cache (and the kv-store) holds against its load; load takes the least loaded")
    kv_store_ram_bytes: PositiveInt = option(default_of(KVStoreSettings, "kv_store_ram_bytes"), "the kv-store's RAM "
                                             "tier", metavar="N",
                                             shown_default=shown_default_of(KVStoreSettings, "kv_store_ram_bytes"))
    kv_store_disk_bytes: Count = option(default_of(KVStoreSettings, "kv_store_disk_bytes"), "the kv-store's disk "
                                        "tier, kept in the run directory (0: none)", metavar="N")

    # NATS and security.
    nats: str | None = option(None, "use this NATS server (with JetStream) instead of starting one; a cluster's as "
                              "URL,URL,...", metavar="URL", env="SPLITSERVE_NATS_URL")
    nats_cluster: PositiveInt = option(1, "start N embedded NATS servers clustered on loopback (JetStream "
                                       "replicated; 3 rides out the loss of one) instead of one", metavar="N")
    nats_replicas: PositiveInt | None = option(None, "copies of each JetStream stream and bucket", metavar="N",
                                               shown_default=shown_default_of(BusSettings, "nats_replicas"))
    nats_creds_dir: str | None = option(None, "with --nats: each service instance's credentials, DIR/ID.nk, and "
                                        "the admin key that provisions the streams, DIR/admin.nk, if the operator "
                                        "has not (`splitserve nats-auth DIR` writes them and the server's "
                                        "authorization config)", metavar="DIR")
    nats_auth: bool = option(True, "the embedded NATS server admits only this deployment's services, each instance "
                             "with its own credentials (RUN_DIR/creds/ID.nk) and only the subjects its job needs; "
                             "its streams are made by an admin key this launcher keeps in memory only")
    tls: bool = option(False, "the embedded NATS server and every worker's KV side channel speak only TLS, with "
                       "certificates from a CA made for this deployment (RUN_DIR/tls); every service trusts that CA "
                       "alone")
    nats_tls_ca: str | None = option(None, "with --nats: talk TLS to it, trusting this CA", metavar="FILE")
    nats_connect_timeout_s: PositiveSeconds = option(5.0, "seconds a --nats server may take to answer",
                                                     flag="--nats-connect-timeout", metavar="S")
    namespace: str = option(default_of(BusSettings, "namespace"), "subject prefix of this deployment")

    # Observing it, and its life.
    trace_viewer: bool = option(False, "run a local trace viewer (Arize Phoenix, on 127.0.0.1) and send every "
                                "service's traces to it (pip install 'splitserve[trace-viewer]')")
    trace_viewer_port: Port = option(6006, "the trace viewer's UI and OTLP/HTTP port; OTLP/gRPC on the next one",
                                     metavar="PORT")
    run_dir: Path | None = option(None, "where the deployment keeps its state (deployment.json), logs "
                                  "(logs/NAME.log) and the embedded NATS data", metavar="DIR",
                                  shown_default=f"./{DEFAULT_RUN_DIR}")
    log_max_bytes: PositiveInt = option(DEFAULT_MAX_BYTES, "each service's log (RUN_DIR/logs/NAME.log) rotates to "
                                        "NAME.log.1 past N bytes", metavar="N",
                                        shown_default=f"{DEFAULT_MAX_BYTES >> 20} MiB")
    log_backups: PositiveInt = option(DEFAULT_BACKUPS, "rotated logs kept per service, NAME.log.1 to NAME.log.K",
                                      metavar="K")
    fork_services: bool = option(True, "start each service as a fork of one process that has already imported torch "
                                 "and transformers (starts, restarts and scale-ups without several CPU seconds of "
                                 "imports each); off: each service in an interpreter of its own")
    ready_timeout_s: PositiveSeconds = option(300.0, "give up if the deployment is not ready after S seconds",
                                              flag="--ready-timeout", metavar="S")
    stop_timeout_s: PositiveSeconds = option(10.0, "on stop, seconds each service has to exit after SIGTERM before "
                                             "SIGKILL", flag="--stop-timeout", metavar="S")
