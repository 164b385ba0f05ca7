"""Tool calls as structured output: the grammar the output is held to, and reading calls from it as it streams."""

import json

import llguidance
import pytest

from services.gateway.tool_calls import ToolCallOutput, ToolCallScanner, calls_grammar, describe_tools

F = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
G = {"name": "g"}
CALLS = [("f", {"x": 1, "s": "a}b\"c]", "deep": [{"y": [2]}]}), ("g", {})]
TEXT = "".join("<tool_call>" + json.dumps({"name": name, "arguments": args}, separators=(",", ":")) + "</tool_call>"
               for name, args in CALLS)


def follows(grammar: str, text: str) -> bool:
    """Whether the grammar's byte-level parser takes `text` whole (no tokenizer needed)."""
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), llguidance.LLMatcher.grammar_from_lark(grammar),
                                   log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("mode,named,parallel,text,ok", [
    ("required", None, True, TEXT, True),
    ("required", None, True, '<tool_call>{"name":"f","arguments":{}}</tool_call>', False),  # x is required
    ("required", None, True, '<tool_call>{"name":"h","arguments":{}}</tool_call>', False),  # not offered
    ("required", None, True, "Sure!", False),
    ("required", None, False, '<tool_call>{"name":"g","arguments":{}}</tool_call>' * 2, False),  # one call only
    ("named", "g", True, '<tool_call>{"name":"g","arguments":{}}</tool_call>', True),
    ("named", "g", True, '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>', False),
    ("auto", None, True, "Sure, it is sunny.", True),
    ("auto", None, True, '<tool_call>{"name":"g","arguments":{}}</tool_call>', True),
    ("auto", None, True, "<b>bold</b>", False),  # text may not begin with "<"
    ("auto", None, True, '\n <tool_call>{"name":"g","arguments":{}}</tool_call>', True),  # after whitespace
    ("auto", None, True, " <b>bold</b>", False),  # nor after whitespace
    ("auto", None, True, "  Sure.", True),
    ("required", None, True, '<tool_call>{"name":"g","arguments":"hi"}</tool_call>', False),  # arguments: an object
])
def test_the_grammar_holds_calls_of_the_offered_functions(mode, named, parallel, text, ok):
    assert follows(calls_grammar([F, G], mode, named, parallel), text) is ok


@pytest.mark.parametrize("piece", [1, 2, 7, len(TEXT)])
def test_calls_read_in_pieces_of_any_size_are_the_same_calls(piece):
    scanner, deltas = ToolCallScanner(), []
    for start in range(0, len(TEXT), piece):
        deltas += scanner.feed(TEXT[start:start + piece])
    expected = [(name, json.dumps(args, separators=(",", ":"))) for name, args in CALLS]
    assert [(c.name, c.arguments) for c in scanner.calls] == expected
    # Deltas: the id and name first, then the arguments, which add up to the whole.
    heads = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in heads] == [(0, "f"), (1, "g")] and heads[0].id != heads[1].id
    for index, (_, arguments) in enumerate(expected):
        assert "".join(d.arguments for d in deltas if d.index == index) == arguments


def test_a_functions_own_definitions_are_reachable_from_its_arguments():
    point = {"type": "object", "properties": {"x": {"type": "integer"}, "next": {"$ref": "#/$defs/Point"}},
             "required": ["x"]}
    f = {"name": "f", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
                                     "required": ["p"], "$defs": {"Point": point}}}
    g = {"name": "g", "parameters": {"properties": {"q": {"$ref": "#/definitions/Point"}},
                                     "definitions": {"Point": {"type": "string"}}}}  # the same name, another schema
    grammar = calls_grammar([f, g], "required")
    assert follows(grammar, '<tool_call>{"name":"f","arguments":{"p":{"x":1,"next":{"x":2}}}}</tool_call>')
    assert follows(grammar, '<tool_call>{"name":"g","arguments":{"q":"hi"}}</tool_call>')
    assert not follows(grammar, '<tool_call>{"name":"g","arguments":{"q":{"x":1}}}</tool_call>')


def test_auto_output_is_text_or_calls_and_says_so_in_its_finish_reason():
    text = ToolCallOutput("auto")
    assert text.feed("") == (None, []) and text.feed("Hello") == ("Hello", []) and text.calls is None
    assert text.finish_reason("stop") == "stop"
    calls = ToolCallOutput("auto")
    content, deltas = calls.feed(TEXT)
    assert content is None and [d.get("id") is not None for d in deltas][:1] == [True]
    assert calls.finish_reason("stop") == "tool_calls" and len(calls.calls) == 2
    spaced = ToolCallOutput("auto")
    assert spaced.feed(" \n") == (None, []) and spaced.is_calls is None  # whitespace alone: not known yet
    assert spaced.feed("Hi") == (" \nHi", [])
    spaced_calls = ToolCallOutput("auto")
    spaced_calls.feed(" ")
    spaced_calls.feed(TEXT)
    assert spaced_calls.is_calls and len(spaced_calls.calls) == 2
    named = ToolCallOutput("named")
    named.feed(TEXT)
    assert named.finish_reason("stop") == "stop" and named.finish_reason("length") == "length"


def test_a_call_cut_short_keeps_what_arrived():
    scanner = ToolCallScanner()
    scanner.feed('<tool_call>{"name":"f","arguments":{"x":1')
    assert [(c.name, c.arguments) for c in scanner.calls] == [("f", '{"x":1')]
    assert ToolCallScanner().feed('<tool_call>{"name":"f"') == []  # the name not yet known whole: nothing yet


def test_a_template_without_tools_is_told_of_them_in_the_system_message():
    told = describe_tools([{"role": "user", "content": "hi"}], [F])
    assert told[0]["role"] == "system" and '"name": "f"' in told[0]["content"] and "<tool_call>" in told[0]["content"]
    kept = describe_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [F])
    assert kept[0]["content"].startswith("Be brief.") and len(kept) == 2
