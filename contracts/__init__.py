"""The wire: typed msgpack messages and the subjects they travel on."""

from contracts.codec import ContractError, Message, decode_one_of
from contracts.messages import (
    Assignment,
    CancelRequest,
    GenerateRequest,
    HandoffReply,
    KVEvents,
    KVShipped,
    KVSnapshotRequest,
    KVStoreGet,
    KVStoreLookup,
    KVStorePut,
    KVStoreReply,
    LogprobEntry,
    PrefillJob,
    PrefillResult,
    RequestFailed,
    RoleSwitch,
    RoleSwitchReply,
    ServeModel,
    ServeModelReply,
    ServiceInfo,
    ServiceStats,
    StageActivation,
    StageShipment,
    StageTicketReply,
    StageTicketRequest,
    StatsRequest,
    StepTrace,
    STREAM_ALIVE_EVERY_S,
    StreamAlive,
    TokenChunk,
    TransferEndpoint,
    TransferTicket,
    WorkerLoad,
)
from contracts.subjects import Sender, Subjects, check_token, from_anyone, model_namespace, sender_of, sent_by

__all__ = [
    "Assignment", "CancelRequest", "ContractError", "GenerateRequest", "HandoffReply",
    "KVEvents", "KVShipped", "KVSnapshotRequest", "KVStoreGet", "KVStoreLookup", "KVStorePut", "KVStoreReply",
    "LogprobEntry", "Message", "PrefillJob", "PrefillResult", "RequestFailed", "RoleSwitch", "RoleSwitchReply", "ServeModel",
    "ServeModelReply", "ServiceInfo",
    "ServiceStats", "StageActivation", "StageShipment", "StageTicketReply", "StageTicketRequest", "StatsRequest", "StepTrace",
    "STREAM_ALIVE_EVERY_S", "Sender", "StreamAlive", "Subjects", "TokenChunk", "TransferEndpoint", "TransferTicket", "WorkerLoad", "check_token", "decode_one_of",
    "from_anyone", "model_namespace", "sender_of", "sent_by",
]
