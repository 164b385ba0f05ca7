"""The contracts' codec: every message round-trips; anything not what the class declares is refused, with a reason."""

import msgpack
import pytest

import contracts
from contracts import (
    CancelRequest,
    ContractError,
    GenerateRequest,
    LogprobEntry,
    Message,
    RequestFailed,
    ServiceInfo,
    ServiceStats,
    StageActivation,
    StepTrace,
    TokenChunk,
    decode_one_of,
)
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_batch import StepBatch


def generate_request(**fields) -> GenerateRequest:
    return GenerateRequest(**{"request_id": "r-1", "model": "m", "prompt_token_ids": [1, 2, 3],
                              "sampling": SamplingParams(temperature=0.5), "reply_subject": "x.y", "deadline_ms": 5,
                              "created_ms": 4, **fields})


def body_of(message: Message, **changes) -> bytes:
    return msgpack.packb({**msgpack.unpackb(message.encode()), **changes})


def refused(data: bytes, cls=GenerateRequest) -> ContractError:
    with pytest.raises(ContractError) as raised:
        cls.decode(data)
    return raised.value


def test_every_message_class_has_its_own_type_name_and_round_trips_its_defaults():
    classes = [getattr(contracts, name) for name in contracts.__all__
               if isinstance(getattr(contracts, name), type) and issubclass(getattr(contracts, name), Message)
               and getattr(contracts, name) is not Message]
    names = [cls.type_name() for cls in classes]
    assert len(classes) == 27 and len(set(names)) == len(names) and all(names)
    request = generate_request(prefill="remote", prefill_instance="prefill-2")
    assert GenerateRequest.decode(request.encode()) == request
    chunk = TokenChunk(request_id="r", seq=3, token_ids=[7], text="a", logprobs=[LogprobEntry(token_id=7, logprob=-0.5)])
    assert TokenChunk.decode(chunk.encode()) == chunk
    info = ServiceInfo(instance_id="d-0", role="decode", num_running=2)
    assert ServiceInfo.decode(info.encode()) == info
    stats = ServiceStats.of(info, {"nested": {"a": [1, 2]}})
    assert ServiceStats.decode(stats.encode()) == stats and stats.num_running == 2
    with pytest.raises(ContractError, match="service_info"):  # a registry entry carries no counters
        ServiceInfo.decode(stats.encode())
    batch = StepBatch(request_ids=["a", "b"], token_ids=[5, 6, 7], positions=[3, 0, 1], query_lens=[1, 2],
                      context_lens=[4, 2], block_tables=[[0], [1]], sample_indices=[0, 1], block_size=16)
    step = StageActivation(step_id=1, head="h", route=["s1"], batch=batch, kind="hidden",
                           deadline_ms=9, data=b"\x00\x01",
                           traces=[StepTrace(request_id="a", tokens=1, traceparent="00-ab-cd-01")])
    decoded = StageActivation.decode(step.encode())
    assert decoded == step and decoded.data == b"\x00\x01"
    assert type(decoded.batch) is StepBatch and decoded.batch == batch  # the engine's own batch
    assert msgpack.unpackb(request.encode())["type"] == "generate_request"
    assert msgpack.unpackb(request.encode())["v"] == 1


@pytest.mark.parametrize("changes, reason, says", [
    ({"type": "cancel_request"}, "wrong_type", "got type 'cancel_request'"),
    ({"v": 2}, "unknown_version", "schema version 2"),
    ({"surprise": 1}, "malformed", "surprise"),
    ({"deadline_ms": True}, "malformed", "deadline_ms"),  # a bool is not an int
    ({"deadline_ms": 1.5}, "malformed", "deadline_ms"),
    ({"prompt_token_ids": [1, "2"]}, "malformed", "prompt_token_ids"),
    ({"model": None}, "malformed", "model"),
    ({"sampling": [1]}, "malformed", "sampling"),
])
def test_a_field_of_the_wrong_kind_is_refused_with_a_reason(changes, reason, says):
    error = refused(body_of(generate_request(), **changes))
    assert error.reason == reason and says in str(error)


def test_what_is_not_a_message_is_refused():
    assert refused(b"\xc1 not msgpack").reason == "malformed"
    assert refused(msgpack.packb([1, 2])).reason == "malformed"
    error = refused(msgpack.packb({"type": "generate_request", "v": 1, "request_id": "r"}))
    assert error.reason == "malformed" and "model" in str(error)


def test_a_float_field_takes_an_int_and_optional_fields_take_none():
    failed = RequestFailed.decode(body_of(RequestFailed(request_id="r", code="c", message="m"), retry_after_s=2))
    assert failed.retry_after_s == 2
    assert RequestFailed.decode(body_of(failed, retry_after_s=None)).retry_after_s is None


def test_decode_one_of_picks_the_class_its_type_names():
    cancel = CancelRequest(request_id="r-9")
    assert decode_one_of(cancel.encode(), GenerateRequest, CancelRequest) == cancel
    assert decode_one_of(generate_request().encode(), GenerateRequest, CancelRequest) == generate_request()
    with pytest.raises(ContractError) as raised:
        decode_one_of(TokenChunk(request_id="r", seq=0, token_ids=[], text="").encode(), GenerateRequest,
                      CancelRequest)
    assert raised.value.reason == "wrong_type"


def test_logprobs_travel_as_typed_entries():
    entry = LogprobEntry(token_id=5, logprob=-0.25, top=[(5, -0.25), (9, -1.5)])
    chunk = TokenChunk(request_id="r", seq=0, token_ids=[5], text="a", logprobs=[entry])
    assert TokenChunk.decode(chunk.encode()).logprobs == [entry]
    wire = msgpack.unpackb(chunk.encode())["logprobs"]
    assert wire == [{"token_id": 5, "logprob": -0.25, "top": [[5, -0.25], [9, -1.5]], "rank": None}]
    for bad in ({"token_id": 5, "logprob": -0.25, "top": [[5]]}, {"token_id": 5, "logprob": "x"},
                {"token_id": 5, "logprob": -0.2, "rank": "1"}, {"token_id": 5, "logprob": -0.2, "rnk": 1}):
        error = refused(body_of(chunk, logprobs=[bad]), TokenChunk)
        assert error.reason == "malformed" and "logprobs" in str(error)
