"""The wire's Sampling part carries every SamplingParams field, and the engine's checks still apply."""

import dataclasses

import msgspec
import pytest

from contracts import GenerateRequest, Sampling
from services.common.sampling_wire import from_wire, to_wire
from shared.engine.errors import InvalidRequestError
from shared.engine.sampling_params import SamplingParams


def test_the_part_has_every_field_with_the_same_defaults():
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(Sampling.__struct_fields__)
    assert to_wire(SamplingParams()) == Sampling() and from_wire(Sampling()) == SamplingParams()


def test_params_cross_the_wire_unchanged():
    params = SamplingParams(max_tokens=7, temperature=0.3, top_p=0.8, top_k=5, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.2, seed=2**62, stop=["\n\n", "END"],
                            stop_token_ids=[3, 9], ignore_eos=True, logprobs=4, skip_special_tokens=False)
    request = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1, 2], sampling=to_wire(params),
                              reply_subject="a.b", deadline_ms=1, created_ms=1)
    assert from_wire(GenerateRequest.decode(request.encode()).sampling) == params


def test_out_of_range_values_are_refused_naming_the_field():
    with pytest.raises(InvalidRequestError) as caught:
        from_wire(Sampling(top_p=1.5))
    assert caught.value.param == "top_p"


def test_mistyped_and_unknown_fields_do_not_decode():
    body = msgspec.msgpack.encode({"type": "generate_request", "v": 1, "request_id": "r", "model": "m",
                                   "prompt_token_ids": [1], "reply_subject": "a.b", "deadline_ms": 1,
                                   "created_ms": 1, "sampling": {"temperature": "hot"}})
    with pytest.raises(ValueError, match="temperature"):
        GenerateRequest.decode(body)
    with pytest.raises(ValueError, match="best_of"):
        GenerateRequest.decode(body.replace(b"\xabtemperature\xa3hot", b"\xa7best_of\x01"))
