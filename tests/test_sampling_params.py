"""SamplingParams, the one sampling type: `validate()` refuses each bad value naming its field, and the type
crosses the contracts' codec as it is (the wire checks types, `validate()` the values)."""

import subprocess
import sys

import msgspec
import pytest

from contracts import ContractError, GenerateRequest, PrefillJob, TransferEndpoint, TransferTicket
from shared.engine.errors import InvalidRequestError
from shared.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams

# The field names on the wire, as the `Sampling` part had them: a message from an older process still decodes.
WIRE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens",
               "spaces_between_special_tokens", "include_stop_str_in_output", "min_tokens", "logit_bias",
               "structured_kind", "structured_spec", "prompt_logprobs", "cache_salt", "tenant", "priority")


@pytest.mark.parametrize("fields, param, says", [
    ({"max_tokens": 0}, "max_tokens", "positive integer"),
    ({"max_tokens": 2.5}, "max_tokens", "positive integer"),
    ({"temperature": -0.5}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"min_p": 2.0}, "min_p", "[0, 1]"),
    ({"presence_penalty": 3.0}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3.0}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "between 0 and 20"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"min_tokens": -1}, "min_tokens", "non-negative"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "must not exceed"),
    ({"structured_kind": "xml"}, "structured_outputs", "unknown structured output kind"),
    ({"structured_spec": "a+"}, "structured_outputs", "needs its kind"),
    ({"cache_salt": 7}, "cache_salt", "string"),
    ({"tenant": "t" * 129}, "tenant", "at most 128"),
    ({"priority": 2**31}, "priority", "integer in"),
    ({"priority": 1.5}, "priority", "integer in"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", "at most"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "token ids"),
    ({"logit_bias": {3: 101.0}}, "logit_bias", "[-100, 100]"),
])
def test_each_bad_value_is_refused_naming_its_field(fields, param, says):
    params = SamplingParams(**fields)  # made as given: only validate() judges the values
    with pytest.raises(InvalidRequestError) as refused:
        params.validate()
    assert refused.value.param == param and says in str(refused.value)


def test_the_bounds_themselves_are_valid_and_a_lone_stop_string_becomes_a_list():
    SamplingParams().validate()
    edge = SamplingParams(max_tokens=None, temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                          logprobs=20, prompt_logprobs=0, logit_bias={0: -100.0, 5: 100})
    edge.validate()
    stop = SamplingParams(stop="END")
    stop.validate()
    assert stop.stop == ["END"] and edge.greedy


def test_the_type_crosses_the_codec_as_it_is():
    assert SamplingParams.__struct_fields__ == WIRE_FIELDS
    params = SamplingParams(max_tokens=7, temperature=0.3, top_p=0.8, top_k=5, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.2, seed=2**62, stop=["\n\n", "END"],
                            stop_token_ids=[3, 9], ignore_eos=True, logprobs=4, skip_special_tokens=False,
                            min_tokens=2, logit_bias={7: -3.5}, structured_kind="regex", structured_spec="a+",
                            prompt_logprobs=1, cache_salt="tenant", tenant="acme", priority=-3)
    request = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1, 2], sampling=params,
                              reply_subject="a.b", deadline_ms=1, created_ms=1)
    decoded = GenerateRequest.decode(request.encode()).sampling
    assert type(decoded) is SamplingParams and decoded == params
    decoded.validate()
    ticket = TransferTicket(transfer_id="t", token=b"k" * 16, endpoint=TransferEndpoint(host="h", port=1, host_id="x"),
                            deadline_unix_s=1.0)
    job = PrefillJob(request_id="r", model="m", prompt_token_ids=[1], sampling=params, ticket=ticket,
                     reply_subject="a.b", block_size=16, model_fingerprint=b"f", deadline_ms=1, created_ms=1)
    assert PrefillJob.decode(job.encode()).sampling == params


def test_an_older_process_message_decodes_and_a_bad_value_decodes_for_validate_to_refuse():
    old = {"type": "generate_request", "v": 1, "request_id": "r", "model": "m", "prompt_token_ids": [1],
           "reply_subject": "a.b", "deadline_ms": 1, "created_ms": 1,
           "sampling": dict(zip(WIRE_FIELDS, msgspec.structs.astuple(SamplingParams(top_p=1.5))))}
    sampling = GenerateRequest.decode(msgspec.msgpack.encode(old)).sampling
    assert sampling == SamplingParams(top_p=1.5)  # the types are right: the decode takes it...
    with pytest.raises(InvalidRequestError) as refused:  # ...and the receiver's validate() does not
        sampling.validate()
    assert refused.value.param == "top_p"


@pytest.mark.parametrize("sampling, says", [
    ({"temperature": "hot"}, "temperature"),
    ({"best_of": 2}, "best_of"),
    ({"stop": "END"}, "stop"),  # on the wire a list only
])
def test_mistyped_and_unknown_fields_do_not_decode(sampling, says):
    body = msgspec.msgpack.encode({"type": "generate_request", "v": 1, "request_id": "r", "model": "m",
                                   "prompt_token_ids": [1], "reply_subject": "a.b", "deadline_ms": 1,
                                   "created_ms": 1, "sampling": sampling})
    with pytest.raises(ContractError, match=says):
        GenerateRequest.decode(body)


def test_contracts_import_no_torch():
    code = "import sys, contracts; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
