"""Every way clients ask for structured output names one constraint, and the field it came from."""

import json

import pytest

from services.gateway.errors import RequestError
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_request, to_sampling_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields,kind,spec,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json", json.dumps(SCHEMA), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_object", "", "response_format"),
    ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA), "structured_outputs"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", json.dumps(SCHEMA), "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+", "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", '["a", "b"]', "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: \"x\""}}, "grammar", "start: \"x\"", "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs"),
    ({"guided_json": SCHEMA}, "json", json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "x+"}, "regex", "x+", "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]', "guided_choice"),
    ({"guided_grammar": "root ::= \"a\""}, "grammar", "root ::= \"a\"", "guided_grammar"),
])
def test_each_way_of_asking_is_one_constraint(fields, kind, spec, param):
    for cls, base in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest,
                                                              {"messages": [{"role": "user", "content": "hi"}]})):
        req = parse_request(cls, {"model": "m", **base, **fields})
        assert (req.constraint.kind, req.constraint.spec, req.constraint.param) == (kind, spec, param)
        params = to_sampling_params(req)
        assert (params.structured_kind, params.structured_spec) == (kind, spec)


def test_text_and_nothing_are_free_text_and_two_constraints_are_refused():
    for fields in ({}, {"response_format": {"type": "text"}}):
        assert parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields}).constraint is None
    with pytest.raises(RequestError) as refused:
        parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]})
    assert refused.value.param == "guided_choice" and "both" in refused.value.message
