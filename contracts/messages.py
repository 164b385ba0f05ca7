"""Every message that crosses NATS, one class each. Field names carry their units."""

from dataclasses import dataclass, field
from typing import Any

from contracts.codec import Message


@dataclass(slots=True, kw_only=True)
class GenerateRequest(Message):
    """gateway -> scheduler (JetStream, de-duplicated by request_id) -> worker."""

    TYPE = "generate_request"
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields
    reply_subject: str  # where the token stream and request events go
    deadline_ms: int  # unix epoch ms after which nobody waits for the answer
    created_ms: int
    prefill: str = "local"  # the scheduler's decision: "local" (the worker prefills) or "remote" (a prefill worker does)
    prefill_instance: str = ""  # with "remote": the prefill worker whose cache holds the prompt's prefix ("" any)


@dataclass(slots=True, kw_only=True)
class PrefillJob(Message):
    """decode worker -> prefill pool (JetStream work queue): compute this prompt's KV and first token."""

    TYPE = "prefill_job"
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # the request's SamplingParams fields, seed always set
    ticket: dict[str, Any]  # shared.transfer TransferTicket: where and how to ship the KV
    reply_subject: str  # where the PrefillResult goes (the decode worker)
    block_size: int  # the decode worker's KV block size; a prefill worker with another one refuses
    model_fingerprint: bytes  # the decode worker's model (weights and KV dtype); a prefill worker with another refuses
    deadline_ms: int  # after this the decode worker has given up (and prefilled locally)
    created_ms: int


@dataclass(slots=True, kw_only=True)
class PrefillResult(Message):
    """prefill worker -> decode worker, before the KV itself: the first token, or why there is none."""

    TYPE = "prefill_result"
    request_id: str
    ok: bool
    prefill_instance: str
    first_token_id: int = -1
    first_logprobs: dict[str, Any] | None = None  # {token_id, logprob, top: [[id, logprob], ...]}
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    will_transfer: bool = True  # False when the request already ended at its first token
    kv_written_back: bool = False  # the prefill worker writes the prompt's full blocks to the kv-store
    model_fingerprint: bytes = b""  # the prefill worker's model; the decode worker uses a result only from its own
    error: str = ""


@dataclass(slots=True, kw_only=True)
class Assignment(Message):
    """worker -> gateway, first on the reply subject: this worker process now owns the request."""

    TYPE = "assignment"
    request_id: str
    worker_instance: str
    worker_boot_id: str  # changes when the worker restarts: the gateway fails requests of a dead boot


@dataclass(slots=True, kw_only=True)
class HandoffReply(Message):
    """worker -> scheduler: whether the worker took the request."""

    TYPE = "handoff_reply"
    request_id: str
    accepted: bool
    code: str = ""  # when not accepted: "overloaded" | "invalid_request" | "draining"
    message: str = ""
    param: str | None = None
    handoffs_taken: int = 0  # when accepted: the worker's requests taken since it started, this one included; its
    # registry entry shows the request once the entry's details["handoffs_taken"] reaches this (0: it does not say)


@dataclass(slots=True, kw_only=True)
class TokenChunk(Message):
    """worker -> gateway: the next tokens of a request; `seq` counts chunks from 0."""

    TYPE = "token_chunk"
    request_id: str
    seq: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[str, Any]] | None = None  # per token: {token_id, logprob, top: [[id, logprob], ...]}
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True, kw_only=True)
class RequestFailed(Message):
    """any service -> gateway: the request ended with an error."""

    TYPE = "request_failed"
    request_id: str
    code: str  # "no_worker" | "invalid_request" | "overloaded" | "worker_failed" | "timeout" | "internal"
    message: str
    param: str | None = None
    retry_after_s: float | None = None


@dataclass(slots=True, kw_only=True)
class CancelRequest(Message):
    """gateway -> everyone: stop working on this request and free what it holds."""

    TYPE = "cancel_request"
    request_id: str
    reason: str = "client_disconnected"


@dataclass(slots=True, kw_only=True)
class ServiceInfo(Message):
    """A service's entry in the registry (heartbeated), also the reply to a stats request."""

    TYPE = "service_info"
    instance_id: str
    role: str  # "gateway" | "scheduler" | "decode" | "prefill" | "stage" | "kvstore"
    model: str = ""
    served_model_name: str = ""
    boot_id: str = ""  # unique per process start
    pid: int = 0
    host: str = ""
    state: str = "starting"  # "starting" | "ready" | "draining"
    started_ms: int = 0
    heartbeat_ms: int = 0
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    max_model_len: int = 0
    http_port: int | None = None  # gateway API / metrics port, when the service serves HTTP
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class StatsRequest(Message):
    TYPE = "stats_request"


@dataclass(slots=True, kw_only=True)
class StageActivation(Message):
    """One pipeline hop of one step: stage -> next stage (hidden states), last stage -> head (logits),
    any stage -> head (kind "error": the step failed there)."""

    TYPE = "stage_activation"
    step_id: int
    head: str  # the head's instance id: logits and errors go back to it
    head_boot_id: str = ""  # ...and its process: a restarted head ignores what comes back for its predecessor
    route: list[str]  # the stages still to run this step, in order; the receiver is the first
    stage_boot_ids: dict[str, str] = field(default_factory=dict)  # the stage processes the head means (a
    # restarted stage has lost the KV of earlier steps, so it must refuse steps meant for its previous boot)
    batch: dict[str, Any]  # shared.engine StepBatch fields
    kind: str  # "hidden" | "logits" | "error"
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    data: bytes = b""  # the tensor, inline (small ones)...
    transfer_id: str = ""  # ...or the side-channel transfer it comes by (big ones)
    error: str = ""
    deadline_ms: int  # after this the head has given up on the step
    ship: list[dict[str, Any]] = field(default_factory=list)  # prompts completing in this step whose KV each
    # stage ships, its own layers, straight to the decode worker: {request_id, ticket, attempt, block_ids, num_tokens}
    traces: list[dict[str, Any]] = field(default_factory=list)  # requests whose prompt this step computes, for the
    # stages' spans: {request_id, tokens, traceparent[, tracestate]} (a few at most)


@dataclass(slots=True, kw_only=True)
class StageTicketRequest(Message):
    """stage -> next hop, before a big activation: expect a side-channel transfer of this id."""

    TYPE = "stage_ticket_request"
    transfer_id: str
    nbytes: int
    deadline_ms: int


@dataclass(slots=True, kw_only=True)
class StageTicketReply(Message):
    """The answer to a StageTicketRequest: a shared.transfer TransferTicket, or why not."""

    TYPE = "stage_ticket_reply"
    ok: bool
    ticket: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass(slots=True, kw_only=True)
class KVShipped(Message):
    """pipeline stage -> its (prefill) head: this stage's layers of a prompt's KV reached the decode worker, or not.
    Until every stage has said so (or the transfer's deadline passed), the head keeps the prompt's blocks."""

    TYPE = "kv_shipped"
    request_id: str
    stage: str
    ok: bool
    attempt: str = ""  # the head's attempt at the job (from the step's ship entry)
    num_bytes: int = 0
    error: str = ""


@dataclass(slots=True, kw_only=True)
class KVStoreLookup(Message):
    """worker -> kv-store: how many of these chained block hashes, from the first, do you hold?"""

    TYPE = "kvstore_lookup"
    hashes: list[bytes]


@dataclass(slots=True, kw_only=True)
class KVStorePut(Message):
    """worker -> kv-store: expect these blocks over the side channel (the reply carries the ticket)."""

    TYPE = "kvstore_put"
    transfer_id: str
    hashes: list[bytes]  # block i of the transfer (its "layer" i) is stored under hashes[i]
    dtype: str
    block_shape: list[int]  # one block, all layers: [layers, 2, block_size, kv_heads, head_dim]
    deadline_ms: int
    model_fingerprint: bytes  # the model that computed the blocks; stored with them


@dataclass(slots=True, kw_only=True)
class KVStoreGet(Message):
    """worker -> kv-store: send me these blocks, block i as "layer" i of the transfer this ticket expects."""

    TYPE = "kvstore_get"
    hashes: list[bytes]
    ticket: dict[str, Any]
    deadline_ms: int
    model_fingerprint: bytes  # the asking worker's model: blocks stored by another are not served


@dataclass(slots=True, kw_only=True)
class KVStoreReply(Message):
    """kv-store -> worker: the answer to a lookup, a put (with the ticket) or a get (the blocks are on their way)."""

    TYPE = "kvstore_reply"
    ok: bool
    num_hit: int = 0
    tiers: list[str] = field(default_factory=list)  # lookup: the tier of each hit
    ticket: dict[str, Any] = field(default_factory=dict)
    error: str = ""



@dataclass(slots=True, kw_only=True)
class KVEvents(Message):
    """worker or kv-store -> schedulers (core NATS, may be lost): blocks it stored and removed since its last message.

    `seq` counts a publisher's messages from 0 per boot, so a gap shows lost events. A `snapshot` message
    replaces everything known of the publisher with its `stored` blocks (a long snapshot goes on in the
    messages that follow it)."""

    TYPE = "kv_events"
    instance_id: str
    role: str  # "decode" | "prefill" | "kvstore"
    boot_id: str
    seq: int
    snapshot: bool = False
    stored: list[bytes] = field(default_factory=list)  # chained block hashes
    removed: list[bytes] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class KVSnapshotRequest(Message):
    """scheduler -> one publisher of KV events: publish a snapshot (it lost events, or just started)."""

    TYPE = "kv_snapshot_request"
    reason: str = ""
