"""The settings the services share, in groups a service's own settings class is made of (by inheritance): the
bus, the status endpoint, the side channel, the model, the engine, the kv-store tier and the CPU loan. Each field
is one flag, one SPLITSERVE_* variable and one default (`services.common.settings`)."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from services.common.settings import Settings, option
from shared.engine import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SCHEDULING_POLICY,
    SCHEDULING_POLICIES,
)
from shared.engine import DEFAULT_MODEL

PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=1, le=65535)]
AnyPort = Annotated[int, Field(ge=0, le=65535)]  # 0: any free one
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Seconds = NonNegative
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Transport = Literal["auto", "shm", "tcp"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
SchedulingPolicy = Literal[SCHEDULING_POLICIES]


def _cpu_list(value: Any) -> Any:
    if isinstance(value, str):
        from services.common.cpus import parse_cpu_list

        return parse_cpu_list(value)  # a ValueError says what is wrong with the list
    return value


CpuList = Annotated[tuple[int, ...], BeforeValidator(_cpu_list)]
Device = Annotated[str, Field(pattern=r"^(cpu|cuda(:\d+)?)$")]
MemoryShare = Annotated[float, Field(gt=0, le=1)]


def _keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    from services.common.api_keys import parse_api_keys, split_key_entry

    keys = parse_api_keys(keys, None)  # blanks dropped, each once
    for entry in keys:
        split_key_entry(entry)  # a malformed KEY:TENANT is refused at startup
    return keys


def _keys_file(path: str | None) -> str | None:
    from services.common.tenant_keys import read_keys_file

    if path is not None:
        read_keys_file(path)  # refused at startup: open to others, malformed (the error never names a key)
    return path


ApiKeys = Annotated[tuple[str, ...], AfterValidator(_keys)]
ApiKeysFile = Annotated[str | None, AfterValidator(_keys_file)]


class BusSettings(Settings):
    """Every service: its NATS connection, its deployment and its name."""

    ROLE: ClassVar[str] = "service"

    nats: str = option("nats://127.0.0.1:4222", "NATS server URL; a cluster's as URL,URL,... (the client fails over "
                       "between them)", metavar="URL", env="SPLITSERVE_NATS_URL")
    nats_replicas: PositiveInt | None = option(None, "copies of each JetStream stream and bucket this service "
                                               "creates or updates", metavar="N",
                                               shown_default="3 on a cluster of 3 nodes or more, else 1")
    nats_creds: str | None = option(None, "this service's NATS credentials: an NKey seed file or a .creds file (or "
                                    "the seed itself in SPLITSERVE_NATS_NKEY_SEED)", metavar="FILE")
    nats_tls_ca: str | None = option(None, "talk TLS to NATS, trusting only this CA", metavar="FILE")
    nats_tls_cert: str | None = option(None, "a client certificate for NATS", metavar="FILE")
    nats_tls_key: str | None = option(None, "its key", metavar="FILE")
    namespace: str = option("splitserve", "subject prefix of this deployment")
    instance_id: str = option(None, "unique name of this service instance (letters, digits, '_' and '-')",
                              shown_default="ROLE-HOST-PID")
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "the lowest level logged")

    @model_validator(mode="before")
    @classmethod
    def _named(cls, values: Any) -> Any:
        if isinstance(values, dict) and not values.get("instance_id"):
            values = {**values, "instance_id": f"{cls.ROLE}-{socket.gethostname()}-{os.getpid()}"}
        return values


class ServiceSettings(BusSettings):
    """A bus service with a status endpoint for probes (every one but the gateway, whose HTTP server has them)."""

    status_port: Port | None = option(None, "serve GET /health (liveness), GET /ready (readiness) and GET "
                                      "/metrics on this port", metavar="PORT", shown_default="none")
    status_host: str = option("127.0.0.1", "the address the status endpoint listens on (0.0.0.0 for a kubelet's "
                              "probes)", metavar="ADDR")


class SideChannelSettings(Settings):
    """A service with a side channel (model workers, stages, the kv-store): where it is reached, TLS on it."""

    advertise_host: str | None = option(None, "the address other hosts reach this service's side channel at, which "
                                        "it listens on", metavar="ADDR",
                                        shown_default="the address of the interface that routes to NATS, 127.0.0.1 "
                                                      "beside a local NATS")
    transfer_tls_ca: str | None = option(None, "side channel over TLS only: trust receivers whose certificate chains "
                                         "to this CA (needs the two below)", metavar="FILE")
    transfer_tls_cert: str | None = option(None, "the certificate this service's receivers present, naming the "
                                           "address they advertise", metavar="FILE")
    transfer_tls_key: str | None = option(None, "its key", metavar="FILE")


class ModelSettings(Settings):
    model: str | None = option(None, "a known model's name (fetched into the cache on first use), a Hugging Face "
                               "model directory or a .gguf file", metavar="NAME|DIR|FILE.gguf",
                               shown_default=DEFAULT_MODEL)
    served_model_name: str | None = option(None, "the name clients ask for", metavar="NAME",
                                           shown_default="the model's")
    dtype: Dtype = option(DEFAULT_DTYPE, "the weights' dtype")


class EngineSettings(Settings):
    """The model runner's, in every worker that embeds the engine."""

    device: Device = option(DEFAULT_DEVICE, "cpu, cuda or cuda:N")
    block_size: PositiveInt = option(DEFAULT_BLOCK_SIZE, "tokens per KV block", metavar="N")
    kv_cache_bytes: PositiveInt = option(DEFAULT_KV_CACHE_BYTES, "memory for the paged KV cache", metavar="N",
                                         shown_default=f"{DEFAULT_KV_CACHE_BYTES >> 20} MiB")
    gpu_memory_utilization: MemoryShare | None = option(
        None, "on a GPU: the share of its memory this worker may use (vLLM's meaning); the KV cache takes what the "
        "weights and a full step's activations leave of it, instead of --kv-cache-bytes", metavar="F",
        shown_default="none: --kv-cache-bytes")
    max_num_seqs: PositiveInt = option(DEFAULT_MAX_NUM_SEQS, "sequences in one step at most", metavar="N")
    max_num_batched_tokens: PositiveInt = option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "tokens in one step at most",
                                                 metavar="N")
    scheduling_policy: SchedulingPolicy = option(
        DEFAULT_SCHEDULING_POLICY, "fair: the batch's places shared between tenants (the highest priority first, then "
        "the tenant holding the fewest; a full batch preempts for a lower priority's or a bigger holder's request); "
        "fcfs: first come first served, whoever the request is for")
    max_model_len: PositiveInt | None = option(None, "the longest sequence (prompt and output) served",
                                               metavar="N", shown_default="the model's")
    prefill_beside_decodes_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = option(
        None, "stall-free chunking: a step that carries decodes lasts about MS, with the prompt chunks that fit "
        "beside them (costs learnt from the steps), so a long prompt never stalls running requests' tokens",
        metavar="MS", shown_default="off, the whole --max-num-batched-tokens")
    cpus: CpuList | None = option(None, "run the worker's threads on these CPUs (e.g. 0-3 or 0,2), one torch thread "
                                  "each", metavar="LIST",
                                  shown_default="wherever the OS places them, torch's default thread count")
    cpus_file: str | None = option(None, "follow the CPU placement the launcher writes to FILE at runtime (a "
                                   "generation and a CPU list, JSON): between engine steps, move every thread to its "
                                   "CPUs and answer in FILE.ack", metavar="FILE")

    @model_validator(mode="after")
    def _memory_share_on_a_gpu(self) -> EngineSettings:
        if self.gpu_memory_utilization is not None and not self.device.startswith("cuda"):
            raise ValueError(f"--gpu-memory-utilization shares out a GPU's memory, and this worker runs on "
                             f"{self.device} (size its KV cache with --kv-cache-bytes)")
        return self


class KVStoreTierSettings(Settings):
    """A model worker's use of the deployment's kv-store."""

    kv_store: bool = option(False, "use the deployment's kv-store: load cached prompt prefixes from it, write "
                            "computed blocks back to it")
    kv_store_timeout: PositiveSeconds = option(5.0, "seconds a kv-store lookup or transfer may take before the "
                                               "worker computes instead", metavar="S")
    kv_store_receiver_host: str | None = option(None, "address the side channel that takes blocks from the kv-store "
                                                "listens on", metavar="ADDR",
                                                shown_default="--advertise-host's")
    kv_store_receiver_advertise: str | None = option(None, "the address the kv-store dials (needed when listening "
                                                     "on 0.0.0.0)", metavar="ADDR")


class LenderSettings(Settings):
    """A prefill worker lends its CPUs while idle to a decode worker on the same host (`services.common.cpu_loan`)."""

    cpu_loan: str | None = option(None, "lend this worker's --cpus, while it has nothing to compute, to the decode "
                                  "worker borrowing through FILE (created here, mode 0600)", metavar="FILE")


class BorrowerSettings(Settings):
    """A decode worker borrows an idle prefill worker's CPUs; both name the same loan file."""

    borrow_cpus: CpuList | None = option(None, "also run decode steps on these CPUs (a prefill worker's --cpus) "
                                         "while the prefill worker lending them through --cpu-loan is idle; needs "
                                         "--cpus", metavar="LIST")
    cpu_loan: str | None = option(None, "the loan file the lending prefill worker creates", metavar="FILE")


class RoleSwitchSettings(Settings):
    """A decode or prefill worker that the operator may switch to the other role (`services.common.role_switch`)."""

    role_switch: bool = option(False, "take the operator's role switches (prefill <-> decode, on the loaded "
                               "engine); the other role runs with its own defaults, and the bus must grant this "
                               "instance both roles")
