"""Typed msgpack messages: one dataclass per message, checked on the way in.

Every message encodes as a msgpack map holding its fields plus `type` and `v`
(the schema version). `decode` accepts only a map of the declared type and
version whose fields have the declared types; anything else raises
`ContractError`, so a receiver can terminate the message, count it and carry on.
No pickle, ever: only msgpack's plain types cross the wire.
"""

import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Self

import msgpack


class ContractError(ValueError):
    """A message that is not what its subject promises. `reason` is a short metric label."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(slots=True, kw_only=True)
class Message:
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    def encode(self) -> bytes:
        body = {name: getattr(self, name) for name in _field_names(type(self))}
        body["type"] = self.TYPE
        body["v"] = self.VERSION
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        return cls.from_map(unpack(data))

    @classmethod
    def from_map(cls, body: dict) -> Self:
        if body.get("type") != cls.TYPE:
            raise ContractError(f"expected a {cls.TYPE!r} message, got type {body.get('type')!r}", "wrong_type")
        if body.get("v") != cls.VERSION:
            raise ContractError(
                f"{cls.TYPE!r} message has schema version {body.get('v')!r}; this receiver speaks {cls.VERSION}",
                "unknown_version",
            )
        hints = _field_types(cls)
        values = {}
        for name, value in body.items():
            if name in ("type", "v"):
                continue
            if name not in hints:
                raise ContractError(f"{cls.TYPE!r} message has an unknown field {name!r}")
            if not _matches(value, hints[name]):
                raise ContractError(f"{cls.TYPE!r} field {name!r} has the wrong type ({type(value).__name__})")
            values[name] = value
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values and _is_required(f)]
        if missing:
            raise ContractError(f"{cls.TYPE!r} message lacks {', '.join(missing)}")
        return cls(**values)


def unpack(data: bytes) -> dict:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ContractError(f"not a msgpack message: {exc}") from exc
    if not isinstance(body, dict):
        raise ContractError(f"a message must be a msgpack map, got {type(body).__name__}")
    return body


def decode_one_of(data: bytes, *classes: type[Message]) -> Message:
    """Decode a message that may be any of `classes` (a subject carrying several types)."""
    body = unpack(data)
    for cls in classes:
        if body.get("type") == cls.TYPE:
            return cls.from_map(body)
    raise ContractError(f"unexpected message type {body.get('type')!r}", "wrong_type")


def _is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A message class's field names (`dataclasses.fields` walks the class on every call: a token chunk's
    encode spent most of its time there)."""
    return tuple(f.name for f in dataclasses.fields(cls))


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (str, bytes):
        return isinstance(value, hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict or hint is dict:
        args = typing.get_args(hint) or (Any, Any)
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    raise TypeError(f"unsupported field type {hint!r}")
