"""The wire: typed msgpack messages and the subjects they travel on."""

from contracts.codec import ContractError, Message, decode_one_of
from contracts.messages import (
    Assignment,
    CancelRequest,
    GenerateRequest,
    HandoffReply,
    KVEvents,
    LogprobEntry,
    KVShipped,
    KVSnapshotRequest,
    KVStoreGet,
    KVStoreLookup,
    KVStorePut,
    KVStoreReply,
    PrefillJob,
    PrefillResult,
    RequestFailed,
    Sampling,
    ServiceInfo,
    StageActivation,
    StageTicketReply,
    StageTicketRequest,
    StatsRequest,
    TokenChunk,
    WorkerLoad,
)
from contracts.subjects import Subjects, check_token

__all__ = [
    "Assignment", "CancelRequest", "ContractError", "GenerateRequest", "HandoffReply", "KVEvents", "KVShipped", "KVSnapshotRequest", "KVStoreGet", "KVStoreLookup", "KVStorePut", "KVStoreReply", "LogprobEntry", "Message", "PrefillJob", "PrefillResult",
    "RequestFailed", "Sampling", "ServiceInfo", "StageActivation", "StageTicketReply", "StageTicketRequest", "StatsRequest", "Subjects", "TokenChunk", "WorkerLoad", "check_token", "decode_one_of",
]
