"""Typed msgpack messages: one msgspec struct per message, checked on the way in.

Every message encodes as a msgpack map holding its fields plus `type` (the
struct's tag) and `v` (the schema version). `decode` accepts only a map of the
declared type and version whose fields have the declared types (validated in
msgspec's C decoder, not field by field in Python); anything else raises
`ContractError`, so a receiver can terminate the message, count it and carry on.
No pickle, ever: only msgpack's plain types cross the wire.
"""

import functools
from typing import Any, ClassVar, Self, Union

import msgspec


class ContractError(ValueError):
    """A message that is not what its subject promises. `reason` is a short metric label."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


class Part(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A typed part nested in messages (a map on the wire, checked like the message around it)."""


class Message(msgspec.Struct, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    """A message class names its `type` with the class keyword `tag="..."`. A new schema version raises
    VERSION and the default of `v` together."""

    VERSION: ClassVar[int] = 1
    v: int = 1

    @classmethod
    def type_name(cls) -> str:
        return cls.__struct_config__.tag

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        return _decode(data, cls, _decoder(cls))


_ENCODER = msgspec.msgpack.Encoder()


@functools.cache
def _decoder(message_type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(message_type)


def decode_one_of(data: bytes, *classes: type[Message]) -> Message:
    """Decode a message that may be any of `classes` (a subject carrying several types)."""
    return _decode(data, classes, _decoder(Union[classes]))


def _decode(data: bytes, expected: type[Message] | tuple[type[Message], ...], decoder) -> Message:
    try:
        message = decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _explained(data, expected, exc) from exc
    if message.v != message.VERSION:
        raise ContractError(f"{message.type_name()!r} message has schema version {message.v!r}; this receiver "
                            f"speaks {message.VERSION}", "unknown_version")
    return message


def _explained(data: bytes, expected, exc: Exception) -> ContractError:
    """Why `data` did not decode, told apart the slow way (only for messages that fail)."""
    body = unpack(data)
    classes = expected if isinstance(expected, tuple) else (expected,)
    matching = [cls for cls in classes if body.get("type") == cls.type_name()]
    if not matching:
        names = " or ".join(repr(cls.type_name()) for cls in classes)
        return ContractError(f"expected a {names} message, got type {body.get('type')!r}", "wrong_type")
    cls = matching[0]
    if body.get("v") != cls.VERSION:
        return ContractError(f"{cls.type_name()!r} message has schema version {body.get('v')!r}; this receiver "
                             f"speaks {cls.VERSION}", "unknown_version")
    return ContractError(f"{cls.type_name()!r} message: {exc}")


def unpack(data: bytes) -> dict:
    """A payload as a plain map (no type checks): for error paths that want what they can read of it."""
    try:
        body = msgspec.msgpack.decode(data)
    except Exception as exc:
        raise ContractError(f"not a msgpack message: {exc}") from exc
    if not isinstance(body, dict):
        raise ContractError(f"a message must be a msgpack map, got {type(body).__name__}")
    return body


def to_builtins(part: Any) -> Any:
    """A message or part as plain dicts and lists (for logs and JSON)."""
    return msgspec.to_builtins(part)

