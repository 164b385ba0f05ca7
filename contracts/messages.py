"""Every message that crosses NATS, one class each. Field names carry their units."""

from typing import Annotated, Any

from msgspec import Meta, field

from contracts.codec import Message, Part
# The engine's own sampling and step types travel as parts, as they are (light modules: msgspec only).
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_batch import StepBatch


class LogprobEntry(Part, kw_only=True):
    """One sampled token's logprob and the top-N alternatives, best first (N: the request's `logprobs`)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob)
    rank: int | None = None  # the token's rank (1: the likeliest); given for prompt tokens

    @classmethod
    def of(cls, sampled) -> "LogprobEntry":
        """From the engine's `TokenLogprobs` (anything with token_id, logprob, top and rank)."""
        return cls(token_id=sampled.token_id, logprob=sampled.logprob, top=list(sampled.top),
                   rank=getattr(sampled, "rank", None))


class TransferEndpoint(Part, frozen=True, kw_only=True):
    """Where a side-channel receiver listens, which shared-memory domain it is in (a sender with the same
    `host_id` can use shm), and whether it takes TLS only."""

    host: str
    port: Annotated[int, Meta(ge=1, le=65535)]
    host_id: str
    tls: bool = False


class TransferTicket(Part, frozen=True, kw_only=True):
    """Made by a side-channel receiver for one expected transfer; travels to the sender inside a NATS message.
    `token` proves the sender is the one the receiver meant: it never crosses the side channel in clear (only
    HMACs keyed by it do), nor shows in a repr, a log line or an error."""

    transfer_id: Annotated[str, Meta(min_length=1)]
    token: Annotated[bytes, Meta(min_length=16)]
    endpoint: TransferEndpoint
    deadline_unix_s: float

    def __repr__(self) -> str:
        return f"TransferTicket(transfer_id={self.transfer_id!r}, endpoint={self.endpoint!r}, token=<secret>)"


class GenerateRequest(Message, tag="generate_request", kw_only=True):
    """gateway -> scheduler (JetStream, de-duplicated by request_id) -> worker."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str  # where the token stream and request events go
    deadline_ms: int  # unix epoch ms after which nobody waits for the answer
    created_ms: int
    prefill: str = "local"  # the scheduler's decision: "local" (the worker prefills) or "remote" (a prefill worker does)
    prefill_instance: str = ""  # with "remote": the prefill worker whose cache holds the prompt's prefix ("" any)
    # A request moved from a worker that failed: the tokens its client already has. The new worker computes them
    # again after the prompt and streams what follows (its chunks counted from 0 again).
    resume_output_token_ids: list[int] = field(default_factory=list)
    moved_from: list[str] = field(default_factory=list)  # the worker processes (boot ids) it failed on: never
    # offered to them again (the same worker restarted is another process, and may take it)
    # Times it has moved. A moved request whose client has a stream open waits (until its deadline) for a worker
    # to come back, where a new one is refused at once with a Retry-After.
    moves: int = 0
    # The role epochs it was routed under (`ServiceInfo.role_epoch`): the decode worker's, and with
    # `prefill_instance` that prefill worker's. A worker whose epoch moved on (it switched role since) refuses it
    # ("stale_role") and the scheduler routes it again. None: the sender did not say (only a worker that never
    # switched takes it).
    role_epoch: int | None = None
    prefill_epoch: int | None = None


class PrefillJob(Message, tag="prefill_job", kw_only=True):
    """decode worker -> prefill pool (JetStream work queue): compute this prompt's KV and first token."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # the request's, seed always set
    ticket: TransferTicket  # where and how to ship the KV
    reply_subject: str  # where the PrefillResult goes (the decode worker)
    block_size: int  # the decode worker's KV block size; a prefill worker with another one refuses
    model_fingerprint: bytes  # the decode worker's model (weights and KV dtype); a prefill worker with another refuses
    deadline_ms: int  # after this the decode worker has given up (and prefilled locally)
    created_ms: int
    role_epoch: int | None = None  # offered to one worker: its role epoch the scheduler saw (None: queued)


class PrefillResult(Message, tag="prefill_result", kw_only=True):
    """prefill worker -> decode worker, before the KV itself: the first token, or why there is none."""

    request_id: str
    ok: bool
    prefill_instance: str
    first_token_id: int = -1
    first_logprobs: LogprobEntry | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    will_transfer: bool = True  # False when the request already ended at its first token
    kv_written_back: bool = False  # the prefill worker writes the prompt's full blocks to the kv-store
    model_fingerprint: bytes = b""  # the prefill worker's model; the decode worker uses a result only from its own
    job_token: bytes = b""  # the job's ticket token, echoed: the decode worker believes only the worker that took it
    error: str = ""


class Assignment(Message, tag="assignment", kw_only=True):
    """worker -> gateway, first on the reply subject: this worker process now owns the request."""

    request_id: str
    worker_instance: str
    worker_boot_id: str  # changes when the worker restarts: the gateway fails requests of a dead boot


class HandoffReply(Message, tag="handoff_reply", kw_only=True):
    """worker -> scheduler: whether the worker took the request."""

    request_id: str
    accepted: bool
    code: str = ""  # when not accepted: "overloaded" | "invalid_request" | "draining" | "stale_role"
    message: str = ""
    param: str | None = None
    handoffs_taken: int = 0  # when accepted: the worker's requests taken since it started, this one included; its
    # registry entry shows the request once the entry's details["handoffs_taken"] reaches this (0: it does not say)


class TokenChunk(Message, tag="token_chunk", kw_only=True):
    """worker -> gateway: the next tokens of a request; `seq` counts chunks from 0."""

    request_id: str
    seq: int
    token_ids: list[int]
    text: str
    logprobs: list[LogprobEntry] | None = None  # per token, when the request asked for logprobs
    # With the first chunk, when the request asked for them: prompt tokens 1.. (token 0 has none), with ranks
    prompt_logprobs: list[LogprobEntry] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# A worker sends a word (a chunk, or a StreamAlive) for each request it holds at least this often.
STREAM_ALIVE_EVERY_S = 1.0


class StreamAlive(Message, tag="stream_alive", kw_only=True):
    """worker -> gateway, on the reply subject: the worker still holds the request, though it sent nothing for a
    while (queued, or a long prompt): the gateway's idle deadline starts again."""

    request_id: str


class RequestFailed(Message, tag="request_failed", kw_only=True):
    """any service -> gateway: the request ended with an error."""

    request_id: str
    code: str  # "no_worker" | "invalid_request" | "overloaded" | "worker_failed" | "timeout" | "cancelled" |
    # "internal"
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    # The worker that reports it is whole: what failed was behind it (a pipeline stage that restarted, taking
    # the request's KV), so a moved request may come back to it once it serves again.
    worker_intact: bool = False


class CancelRequest(Message, tag="cancel_request", kw_only=True):
    """gateway -> everyone: stop working on this request and free what it holds."""

    request_id: str
    reason: str = "client_disconnected"


class ServiceInfo(Message, tag="service_info", kw_only=True):
    """A service's entry in the registry (heartbeated): who it is, whether it is alive and ready, and the load and
    KV layout that routing reads. Typed fields only; its counters travel on request (`ServiceStats`)."""

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
    active_requests: int = 0  # a decode worker's requests taken and not ended (loading or awaiting a prefill too)
    handoffs_taken: int = 0  # a decode worker's requests taken since it started: an entry counting one shows it
    kv_block_size: int = 0  # tokens per KV block, where the service has a paged KV cache (engine workers, stages)
    kv_fingerprint: bytes = b""  # an engine worker's model (weights and KV dtype): with the block size, how a
    # prompt hashes into the block hashes of its cache (shared.engine.block_hash)
    layer_range: tuple[int, int] | None = None  # a pipeline stage's decoder layers [start, end)
    uses_kv_store: bool = False  # an engine worker that loads prefixes from the kv-store (so it holds theirs too)
    publishes_kv_events: bool = False  # it tells the schedulers which blocks it holds (KVEvents)
    role_epoch: int = 0  # an engine worker's role switches since it started: messages routed to it carry it


class ServiceStats(ServiceInfo, tag="service_stats", kw_only=True):
    """A service's reply to a stats request: its entry as of now, and its counters (`details`, for metrics,
    people and tests: nothing routes by them)."""

    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, info: ServiceInfo, details: dict[str, Any]) -> "ServiceStats":
        return cls(**{name: getattr(info, name) for name in info.__struct_fields__}, details=details)


class StatsRequest(Message, tag="stats_request", kw_only=True):
    """anyone -> a service: reply with your ServiceStats."""


class RoleSwitch(Message, tag="role_switch", kw_only=True):
    """admin (the launcher, for the operator) -> one switchable worker: drain, then serve as `to` on the same
    engine. `drain_s`: how long its running work may go on before it is handed back (None: its drain timeout)."""

    to: str  # "prefill" | "decode"
    drain_s: Annotated[float, Meta(ge=0, le=600)] | None = None


class RoleSwitchReply(Message, tag="role_switch_reply", kw_only=True):
    """The worker's answer, once it serves in its new role (or why it did not switch)."""

    ok: bool
    role: str  # its role now
    role_epoch: int  # its epoch now
    code: str = ""  # when not ok: "same_role" | "not_switchable" | "unknown_role" | "busy" | "failed"
    error: str = ""
    drain_s: float = 0.0  # the old role's drain
    switch_s: float = 0.0  # from the drain's end to serving in the new role, registered


class ServeModel(Message, tag="serve_model", kw_only=True):
    """admin (the launcher, for `splitserve models serve|unserve`) -> the gateway: start routing `served_name` to
    the pools in `namespace` (its tokenizer, chat template and context length read from `model`, a model
    directory), or stop (`serve` false: new requests for it get 404, open streams finish)."""

    served_name: str
    serve: bool
    model: str = ""
    namespace: str = ""


class ServeModelReply(Message, tag="serve_model_reply", kw_only=True):
    """The gateway's answer once it routes (or no longer routes) the model."""

    ok: bool
    models: list[str]  # the served names it routes now
    code: str = ""  # when not ok: "unknown_model" | "already_served" | "last_model" | "failed"
    error: str = ""


class StageShipment(Part, kw_only=True):
    """A prompt completing in a pipeline step whose KV each stage ships, its own layers, straight to the decode
    worker: where (the ticket), its blocks and tokens, and the head's attempt at the job (for its reports)."""

    request_id: str
    ticket: TransferTicket
    attempt: str
    block_ids: list[int]
    num_tokens: int


class StepTrace(Part, kw_only=True):
    """A request whose prompt a pipeline step computes (`tokens` of it), with its trace context, so that each
    stage's share of the prompt shows in the request's trace."""

    request_id: str
    tokens: int
    traceparent: str
    tracestate: str = ""


class StageActivation(Message, tag="stage_activation", kw_only=True):
    """One pipeline hop of one step: stage -> next stage (hidden states), last stage -> head (logits),
    any stage -> head (kind "error": the step failed there)."""

    step_id: int
    head: str  # the head's instance id: logits and errors go back to it
    head_boot_id: str = ""  # ...and its process: a restarted head ignores what comes back for its predecessor
    route: list[str]  # the stages still to run this step, in order; the receiver is the first
    stage_boot_ids: dict[str, str] = field(default_factory=dict)  # the stage processes the head means (a
    # restarted stage has lost the KV of earlier steps, so it must refuse steps meant for its previous boot)
    batch: StepBatch
    kind: str  # "hidden" | "logits" | "error"
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    data: bytes = b""  # the tensor, inline (small ones)...
    transfer_id: str = ""  # ...or the side-channel transfer it comes by (big ones)
    error: str = ""
    deadline_ms: int  # after this the head has given up on the step
    ship: list[StageShipment] = field(default_factory=list)
    traces: list[StepTrace] = field(default_factory=list)  # a few at most


class StageTicketRequest(Message, tag="stage_ticket_request", kw_only=True):
    """stage -> next hop, before a big activation: expect a side-channel transfer of this id."""

    transfer_id: str
    nbytes: int
    deadline_ms: int


class StageTicketReply(Message, tag="stage_ticket_reply", kw_only=True):
    """The answer to a StageTicketRequest: the ticket to send the activation with, or why not."""

    ok: bool
    ticket: TransferTicket | None = None
    error: str = ""


class KVShipped(Message, tag="kv_shipped", kw_only=True):
    """pipeline stage -> its (prefill) head: this stage's layers of a prompt's KV reached the decode worker, or not.
    Until every stage has said so (or the transfer's deadline passed), the head keeps the prompt's blocks."""

    request_id: str
    stage: str
    ok: bool
    attempt: str = ""  # the head's attempt at the job (from the step's ship entry)
    num_bytes: int = 0
    error: str = ""


class KVStoreLookup(Message, tag="kvstore_lookup", kw_only=True):
    """worker -> kv-store: how many of these chained block hashes, from the first, do you hold?"""

    hashes: list[bytes]
    model_fingerprint: bytes = b""  # the asking worker's model (the store serves only its registered workers)


class KVStorePut(Message, tag="kvstore_put", kw_only=True):
    """worker -> kv-store: expect these blocks over the side channel (the reply carries the ticket)."""

    transfer_id: str
    hashes: list[bytes]  # block i of the transfer (its "layer" i) is stored under hashes[i]
    dtype: str
    block_shape: list[int]  # one block, all layers: [layers, 2, block_size, kv_heads, head_dim]
    deadline_ms: int
    model_fingerprint: bytes  # the model that computed the blocks; stored with them


class KVStoreGet(Message, tag="kvstore_get", kw_only=True):
    """worker -> kv-store: send me these blocks, block i as "layer" i of the transfer this ticket expects."""

    hashes: list[bytes]
    ticket: TransferTicket
    deadline_ms: int
    model_fingerprint: bytes  # the asking worker's model: blocks stored by another are not served


class KVStoreReply(Message, tag="kvstore_reply", kw_only=True):
    """kv-store -> worker: the answer to a lookup, a put (with the ticket) or a get (the blocks are on their way)."""

    ok: bool
    num_hit: int = 0
    tiers: list[str] = field(default_factory=list)  # lookup: the tier of each hit
    ticket: TransferTicket | None = None  # put
    error: str = ""


class KVEvents(Message, tag="kv_events", kw_only=True):
    """worker or kv-store -> schedulers (core NATS, may be lost): blocks it stored and removed since its last message.

    `seq` counts a publisher's messages from 0 per boot, so a gap shows lost events. A `snapshot` message
    replaces everything known of the publisher with its `stored` blocks (a long snapshot goes on in the
    messages that follow it)."""

    instance_id: str
    role: str  # "decode" | "prefill" | "kvstore"
    boot_id: str
    seq: int
    snapshot: bool = False
    stored: list[bytes] = field(default_factory=list)  # chained block hashes
    removed: list[bytes] = field(default_factory=list)


class KVSnapshotRequest(Message, tag="kv_snapshot_request", kw_only=True):
    """scheduler -> one publisher of KV events: publish a snapshot (it lost events, or just started)."""

    reason: str = ""


class WorkerLoad(Message, tag="worker_load", kw_only=True):
    """engine worker -> schedulers (core NATS, may be lost): its load now, sent as it changes (at most every few
    tens of ms), so that routing does not wait a heartbeat to see a request end. The registry entry's fields of
    the same names; a report newer than the entry's heartbeat, from the same boot, takes their place."""

    instance_id: str
    boot_id: str
    sent_ms: int
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    active_requests: int = 0
    handoffs_taken: int = 0
