"""Which structured output a request asks for, in any of the ways clients ask.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` (json, regex, choice,
grammar, json_object) and its older `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` all name one
constraint: a kind and a spec (shared/engine/structured_output.py). `constraint_of` reads them (at most one may
be given) and says which field it came from, so that an error names what the client sent. `check_constraint`
compiles it, on threads of its own and within MAX_COMPILE_S, before the request goes anywhere.
"""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.errors import RequestError, from_failure
from shared.engine import InvalidRequestError, MAX_COMPILE_S, check_structured

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Compiles that outlive their deadline run on here to their end (a thread cannot be stopped): a few threads, so
# that they hold a few CPUs at most.
COMPILE_THREADS = 4
_COMPILERS = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-check")
# A compile holds its thread to its end, its deadline past or not. With every thread held, a constraint is refused
# at once as the server's condition (503, retry), never queued behind others until its own deadline passes: one
# client's slow schemas cannot make everyone else's valid ones 400s.
_FREE_COMPILERS = threading.BoundedSemaphore(COMPILE_THREADS)


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # a SamplingParams.structured_kind
    spec: str
    param: str  # the request field it came from


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` object: one of its fields."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    schema_: Any = Field(default=None, alias="json")  # a JSON schema (or its text); checked by _schema_text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF (told apart by its "::=")
    json_object: bool | None = None


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(message, param, code="invalid_value")


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _invalid(param, "the JSON schema is not valid JSON") from None
    if not isinstance(schema, (dict, bool)):
        raise _invalid(param, "a JSON schema is an object")
    return json.dumps(schema)


def _choices_text(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise _invalid(param, "choice takes a non-empty list of non-empty strings")
    return json.dumps(choices)


def _from_response_format(response_format: dict[str, Any]) -> Constraint | None:
    param = "response_format"
    kind = response_format.get("type")
    unknown = set(response_format) - {"type", "json_schema"}
    if unknown:
        raise RequestError(f"response_format has no field {sorted(unknown)[0]!r}", param, code="unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", param)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise _invalid(param, "response_format json_schema needs a json_schema object")
        unknown = set(spec) - {"name", "description", "schema", "strict"}
        if unknown:
            raise RequestError(f"response_format.json_schema has no field {sorted(unknown)[0]!r}", param,
                               code="unknown_parameter")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise _invalid(param, "response_format.json_schema needs a name")
        if "schema" not in spec:  # as OpenAI's: a schema-less json_schema is any JSON object
            return Constraint("json_object", "", param)
        return Constraint("json", _schema_text(spec["schema"], param), param)
    raise RequestError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                       param, code="unsupported_value")


def _from_structured_outputs(params: StructuredOutputsParams) -> Constraint:
    param = "structured_outputs"
    values = {"json": params.schema_, "regex": params.regex, "choice": params.choice, "grammar": params.grammar,
              "json_object": params.json_object or None}
    given = [name for name, value in values.items() if value is not None]
    if len(given) != 1:
        raise _invalid(param, "structured_outputs takes exactly one of json, regex, choice, grammar and json_object"
                              + (f"; got {', '.join(given)}" if given else ""))
    kind, value = given[0], values[given[0]]
    if kind == "json":
        return Constraint("json", _schema_text(value, param), param)
    if kind == "choice":
        return Constraint("choice", _choices_text(value, param), param)
    if kind == "json_object":
        return Constraint("json_object", "", param)
    if not value:
        raise _invalid(param, f"structured_outputs.{kind} must not be empty")
    return Constraint(kind, value, param)


def _from_guided(field: str, value: Any) -> Constraint:
    kind = GUIDED_FIELDS[field]
    if kind == "json":
        return Constraint("json", _schema_text(value, field), field)
    if kind == "choice":
        return Constraint("choice", _choices_text(value, field), field)
    if not isinstance(value, str) or not value:
        raise _invalid(field, f"{field} takes a non-empty string")
    return Constraint(kind, value, field)


def constraint_of(response_format: dict[str, Any] | None, structured_outputs: StructuredOutputsParams | None,
                  guided: dict[str, Any]) -> Constraint | None:
    """The one constraint the request asks for (None: free text). `guided`: the guided_* fields given."""
    found = []
    if response_format is not None:
        found.append(_from_response_format(response_format))
    if structured_outputs is not None:
        found.append(_from_structured_outputs(structured_outputs))
    found += [_from_guided(name, value) for name, value in guided.items() if value is not None]
    found = [c for c in found if c is not None]
    if len(found) > 1:
        raise _invalid(found[1].param, f"{found[0].param} and {found[1].param} both constrain the output; give one")
    return found[0] if found else None


async def check_constraint(constraint: Constraint, timeout_s: float = MAX_COMPILE_S) -> None:
    """A 400 naming the constraint's field unless it compiles within `timeout_s` (off the event loop, on a thread
    of its own: a 503 when none is free)."""
    if not _FREE_COMPILERS.acquire(blocking=False):
        raise from_failure("overloaded", f"every constraint compiler ({COMPILE_THREADS}) is busy; try again",
                           retry_after_s=1.0)

    def compile_then_free() -> None:
        try:
            check_structured(constraint.kind, constraint.spec)
        finally:
            _FREE_COMPILERS.release()

    try:
        compiling = asyncio.wrap_future(_COMPILERS.submit(compile_then_free))
    except BaseException:
        _FREE_COMPILERS.release()
        raise
    try:
        await asyncio.wait_for(compiling, timeout_s)
    except InvalidRequestError as exc:
        raise _invalid(constraint.param, str(exc)) from None
    except TimeoutError:
        raise _invalid(constraint.param, f"the {constraint.kind} constraint did not compile within "
                                         f"{timeout_s:g} s") from None
