"""Tool calling with `tool_choice` "required" or a named function, by structured output.

The model's output is held to a JSON array of calls of the offered functions,
`[{"name":"<function>","parameters":{<its parameters' schema>}}, ...]` (one call for a named function or without
`parallel_tool_calls`), so it always reads as calls of those functions with arguments their schemas accept.
`ToolCallScanner` reads that text as it streams and gives OpenAI's tool call deltas: a call's id and name once
its name is out, then its arguments as they come.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

ANY_OBJECT = {"type": "object"}
# The start of a call in the array (the grammar writes compact JSON, keys in this order).
_CALL_HEAD = re.compile(r'[\[,]\{"name":"([A-Za-z0-9_-]+)","parameters":')


def calls_schema(functions: list[dict], named: str | None = None, parallel: bool = True) -> dict:
    """The JSON schema of the calls: `functions` are the tools' function objects (name, parameters);
    `named`: only that function, once."""
    chosen = [f for f in functions if named is None or f["name"] == named]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": f["name"]}, "parameters": f.get("parameters") or ANY_OBJECT}}
             for f in chosen]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if named is not None or not parallel:
        schema["maxItems"] = 1
    return schema


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
                head = _CALL_HEAD.match(self.text, self._pos)
                if head is None:
                    if self.text.startswith(("]", "}"), self._pos):  # a call's closing brace, the array's end
                        self._pos += 1
                        continue
                    break  # a call's head, still incomplete
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
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError("a function's parameters are a JSON schema object", f"{param}.function.parameters",
                               code="invalid_value")
        if function["name"] in (f["name"] for f in functions):
            raise RequestError(f"two tools are named {function['name']!r}", f"{param}.function.name",
                               code="invalid_value")
        functions.append(function)
    return functions


def tool_mode(tool_choice, functions: list[dict]) -> tuple[str, str | None] | None:
    """("required", None) or ("named", name) when the output is to be tool calls; None when it is text (no tools,
    tool_choice "none", or none given: the tools are shown to the model, never called)."""
    from services.gateway.errors import RequestError

    if tool_choice is None or tool_choice == "none":
        return None
    if tool_choice == "auto":
        raise RequestError("tool_choice \"auto\" needs a parser of the model's own tool call format, which "
                           "splitserve does not have; use \"required\" or name a function", "tool_choice",
                           code="unsupported_value")
    if not functions:
        raise RequestError("tool_choice needs tools", "tool_choice", code="invalid_value")
    if tool_choice == "required":
        return ("required", None)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice is \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", "tool_choice", code="invalid_value")
    if name not in (f["name"] for f in functions):
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice",
                           code="invalid_value")
    return ("named", name)
