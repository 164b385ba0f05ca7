"""Tool calling by structured output, in the Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The output is held to a grammar (`calls_grammar`): for `tool_choice` "required", one or more calls of the offered
functions (one without `parallel_tool_calls`); for a named function, one call of it; for "auto" (the default when
tools are offered), either text or calls, the model choosing (text then may not begin with "<"). Every call names an
offered function, with arguments its `parameters` schema accepts. The format is the one Hermes-style chat templates
(Qwen, Hermes, SmolLM3...) teach; for a template that does not show tools, `describe_tools` tells the model of them
and of the format in a system message. `ToolCallScanner` reads the output as it streams and gives OpenAI's tool
call deltas: a call's id and name once its name is out, then its arguments as they come.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

ANY_OBJECT = {"type": "object"}
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The start of a call (the grammar writes compact JSON, its keys in this order).
_CALL_HEAD = re.compile(r'<tool_call>\{"name":"([A-Za-z0-9_-]+)","arguments":')


def calls_grammar(functions: list[dict], mode: str, named: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar (llguidance's) of the output: `mode` "required", "named" (`named` the function) or
    "auto"; `functions` are the tools' function objects (name, parameters)."""
    chosen = [f for f in functions if mode != "named" or f["name"] == named]
    definitions: dict = {}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": _arguments_schema(f, i, definitions)}}
             for i, f in enumerate(chosen)]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": {"whitespace_flexible": False}}
    if definitions:
        schema["$defs"] = definitions
    repeat = "" if mode == "named" or not parallel else "+"
    # (calls may follow whitespace, as a tokenizer's "▁<" writes them; text may not begin with "<" after it)
    body = {"auto": "TEXT | LEAD? calls", "required": "LEAD? calls", "named": "LEAD? calls"}[mode]
    return "\n".join([
        "%llguidance {}",
        f"start: {body}",
        f"calls: call{repeat}",
        f"call: {json.dumps(OPEN)} call_json {json.dumps(CLOSE)}",
        f"call_json: %json {json.dumps(schema)}",
        r"LEAD: /[ \t\r\n]{1,8}/",
        *([r"TEXT: /[ \t\r\n]*[^< \t\r\n][\s\S]*/"] if mode == "auto" else []),
    ]) + "\n"


def _arguments_schema(function: dict, index: int, definitions: dict) -> dict:
    """A function's `parameters` as the schema of a call's arguments: always an object, its local definitions
    (`$defs`, `definitions`) moved to the root of the calls' schema (where its `$ref`s now point), as
    `f<index>_<name>` so that two functions' do not collide."""
    parameters = dict(function.get("parameters") or ANY_OBJECT)
    renamed = {}
    for key in ("$defs", "definitions"):
        for name, body in (parameters.pop(key, None) or {}).items():
            renamed[f"#/{key}/{name}"] = f"#/$defs/f{index}_{name}"
            definitions[f"f{index}_{name}"] = body
    parameters.setdefault("type", "object")

    def rewrite(node):
        if isinstance(node, dict):
            return {k: (renamed.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name in [n for n in definitions if n.startswith(f"f{index}_")]:
        definitions[name] = rewrite(definitions[name])
    return rewrite(parameters)


def describe_tools(messages: list[dict], functions: list[dict]) -> list[dict]:
    """`messages` with the tools and the call format told in the system message (added first if there is
    none): for chat templates that do not show tools themselves."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    text = ("You may call functions to help answer. Their signatures, as JSON schemas:\n<tools>\n" + listed +
            "\n</tools>\nTo call one, answer with <tool_call>{\"name\": <function name>, \"arguments\": "
            "<arguments object>}</tool_call>, one such block per call.")
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": (messages[0].get("content") or "") + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


@dataclass(slots=True)
class CallDelta:
    """A piece of tool call `index`: its id and name (first), or more of its arguments."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallScanner:
    """Reads the calls' text as it arrives (`feed`), giving the deltas it completes."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _pos: int = 0  # where scanning goes on
    _depth: int = 0  # inside a call's arguments: JSON nesting depth (0: between calls)
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas: list[CallDelta] = []
        while self._pos < len(self.text):
            if self._depth == 0:
                # Between calls: a call's closing brace and tag, then the next call's head (maybe incomplete).
                head = _CALL_HEAD.search(self.text, self._pos)
                if head is None:
                    break
                call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=head.group(1))
                self.calls.append(call)
                deltas.append(CallDelta(len(self.calls) - 1, id=call.id, name=call.name))
                self._pos = head.end()
                self._depth = -1  # the arguments are about to open
            start = self._pos
            while self._pos < len(self.text) and self._depth != 0:
                self._step(self.text[self._pos])
                self._pos += 1
            piece = self.text[start:self._pos]
            if piece:
                self.calls[-1].arguments += piece
                if deltas and deltas[-1].index == len(self.calls) - 1:
                    deltas[-1].arguments += piece
                else:
                    deltas.append(CallDelta(len(self.calls) - 1, arguments=piece))
            if self._depth != 0:
                break  # the arguments go on in a later piece
        return deltas

    def _step(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth = 1 if self._depth == -1 else self._depth + 1
        elif char in "}]":
            self._depth -= 1


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_tools(tools: list | None) -> list[dict]:
    """The function objects of a request's `tools` (each `{"type": "function", "function": {...}}`), checked:
    a RequestError naming the culprit otherwise."""
    from services.gateway.errors import RequestError

    functions = []
    for i, tool in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestError("a tool is {\"type\": \"function\", \"function\": {...}}", param, code="invalid_value")
        unknown = set(tool) - {"type", "function"} or set(tool["function"]) - {"name", "description", "parameters",
                                                                               "strict"}
        if unknown:
            raise RequestError(f"{param} has no field {sorted(unknown)[0]!r}", param, code="unknown_parameter")
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not _NAME.fullmatch(function["name"]):
            raise RequestError("a function's name is 1 to 64 letters, digits, underscores and dashes",
                               f"{param}.function.name", code="invalid_value")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise RequestError("a function's parameters are a JSON schema of an object", f"{param}.function.parameters",
                               code="invalid_value")
        if function["name"] in (f["name"] for f in functions):
            raise RequestError(f"two tools are named {function['name']!r}", f"{param}.function.name",
                               code="invalid_value")
        functions.append(function)
    return functions


def tool_mode(tool_choice, functions: list[dict]) -> tuple[str, str | None] | None:
    """("auto", None), ("required", None) or ("named", name) when the output is (or may be) tool calls; None when
    it is text (no tools, or tool_choice "none": the tools are shown to the model, never called). Without
    tool_choice, tools offered mean "auto", as OpenAI has it."""
    from services.gateway.errors import RequestError

    if tool_choice == "none" or (tool_choice is None and not functions):
        return None
    if not functions:
        raise RequestError("tool_choice needs tools", "tool_choice", code="invalid_value")
    if tool_choice is None or tool_choice == "auto":
        return ("auto", None)
    if tool_choice == "required":
        return ("required", None)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice is \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", "tool_choice", code="invalid_value")
    if name not in (f["name"] for f in functions):
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice",
                           code="invalid_value")
    return ("named", name)


def is_calls(text: str) -> bool:
    """Whether an output held to `calls_grammar` is calls (text, in "auto", never begins with "<", after any
    whitespace). None while only whitespace has come."""
    stripped = text.lstrip(" \t\r\n")
    return stripped.startswith("<") if stripped else None


class ToolCallOutput:
    """One choice's output under `calls_grammar` (mode "auto", "required" or "named"), read as it streams: text
    (in "auto", when it does not begin with "<") or tool calls."""

    def __init__(self, mode: str):
        self.mode = mode
        self.scanner = ToolCallScanner()
        self.is_calls: bool | None = None if mode == "auto" else True  # None: not known before the first text
        self._undecided = ""  # whitespace that came before it was known

    def feed(self, text: str) -> tuple[str | None, list[dict]]:
        """(content delta, tool call deltas) for more of the output."""
        if self.is_calls is None:
            self._undecided += text
            self.is_calls = is_calls(self._undecided)
            if self.is_calls is None:
                return None, []  # only whitespace yet: text or calls, the next piece says
            text, self._undecided = self._undecided, ""
        if not self.is_calls:
            return (text or None), []
        return None, [delta.as_dict() for delta in self.scanner.feed(text)]

    def finish_reason(self, reason: str | None) -> str | None:
        """As OpenAI says it: calls end with "tool_calls", but a named function's call with "stop"."""
        return "tool_calls" if reason == "stop" and self.is_calls and self.mode != "named" else reason

    @property
    def calls(self) -> list[dict] | None:
        return [call.as_dict() for call in self.scanner.calls] if self.is_calls else None
