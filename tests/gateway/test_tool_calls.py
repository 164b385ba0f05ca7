"""Tool calls as structured output: the schema the output is held to, and reading calls from it as it streams."""

import json

import pytest

from services.gateway.tool_calls import ToolCallScanner, calls_schema

F = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
G = {"name": "g"}
TEXT = ('[{"name":"f","parameters":{"x":1,"s":"a}b\\"c]","deep":[{"y":[2]}]}},'
        '{"name":"g","parameters":{}}]')


def test_the_schema_holds_calls_of_the_offered_functions():
    schema = calls_schema([F, G])
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}  # none given: any object
    named = calls_schema([F, G], named="g")
    assert named["maxItems"] == 1 and named["items"]["properties"]["name"] == {"const": "g"}
    assert calls_schema([F, G], parallel=False)["maxItems"] == 1


@pytest.mark.parametrize("piece", [1, 2, 7, len(TEXT)])
def test_calls_read_in_pieces_of_any_size_are_the_same_calls(piece):
    scanner, deltas = ToolCallScanner(), []
    for start in range(0, len(TEXT), piece):
        deltas += scanner.feed(TEXT[start:start + piece])
    expected = [(c["name"], json.dumps(c["parameters"], separators=(",", ":"))) for c in json.loads(TEXT)]
    assert [(c.name, c.arguments) for c in scanner.calls] == expected
    # Deltas: the id and name first, then the arguments, which add up to the whole.
    heads = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in heads] == [(0, "f"), (1, "g")] and heads[0].id != heads[1].id
    for index, (_, arguments) in enumerate(expected):
        assert "".join(d.arguments for d in deltas if d.index == index) == arguments


def test_a_call_cut_short_keeps_what_arrived():
    scanner = ToolCallScanner()
    scanner.feed('[{"name":"f","parameters":{"x":1')
    assert [(c.name, c.arguments) for c in scanner.calls] == [("f", '{"x":1')]
    assert ToolCallScanner().feed('[{"name":"f"') == []  # the name not yet known to be whole: nothing yet
