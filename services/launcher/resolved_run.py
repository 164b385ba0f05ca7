"""What `splitserve up` found out at start, beyond its settings (`UpSettings`): the plan (`topology.plan`) is made
of the two. Nothing here is a setting's default: each field is a resolved fact, or None where there is none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResolvedRun:
    model_dir: str  # --model resolved to a Hugging Face directory
    served_model_name: str
    nats_url: str  # the embedded server's, or --nats
    cpus: tuple[int, ...]  # shared out among the model workers; () leaves them to the OS
    drain_timeout: float | None  # the gateway's and decode workers' --drain-timeout (None: theirs)
    stage_ranges: tuple[tuple[int, int], ...] = ()  # a pipeline's (or disagg's prefill pipeline's) layers per stage
    chat_template: str | None = None  # --chat-template, a file named by its absolute path
    nats_replicas: int | None = None  # every service's --nats-replicas (None: theirs, by the cluster's size)
    nats_creds_dir: str | None = None  # each service gets --nats-creds DIR/INSTANCE_ID.nk
    nats_tls_ca: str | None = None  # every service talks TLS to NATS, trusting this CA
    transfer_tls: tuple[str, str, str] | None = None  # (CA, cert, key): every side channel speaks TLS only
    cpu_loan_dir: str | None = None  # disagg: idle prefill workers lend their CPUs to decode workers (loan files)
    cpu_placement_dir: str | None = None  # each pinned decode/prefill worker's placement file (--cpus-file) is here
    kv_store_dir: str | None = None  # the kv-store's disk tier (with --kv-store-disk-bytes)
