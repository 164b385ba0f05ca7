"""Typed settings: every option's one home.

A settings class (a frozen pydantic model, subclass of `Settings`) holds each option's type, default and
description. From it come its command-line flag (`add_flags`), its `SPLITSERVE_*` environment variable and its
key in a YAML config file (`settings_from`). Where one option is given in several places, the flag wins, then the
environment, then the config file, then the default. Values are checked by the model (pydantic), wherever they
came from, and a bad one is an error naming where it came from.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

ENV_PREFIX = "SPLITSERVE_"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


S = TypeVar("S", bound=Settings)


class SettingsError(ValueError):
    """A setting that is unknown or not valid, named with where it came from."""


def option(default: Any = None, description: str = "", *, flag: str | None = None, metavar: str | None = None,
           env: str | None = None, shown_default: str | None = None, many: bool = False, joined: bool = False,
           separator: str | None = None, **field: Any) -> Any:
    """A settings field. `flag` (default: --NAME-WITH-DASHES) and `env` (default: SPLITSERVE_ + the flag's name)
    rename them; `shown_default` is how --help writes the default (default: the value itself); `many`: the flag
    repeats and the variable holds A,B,... (a list; items apart by `separator` instead of ',' where an item may
    hold a comma), and `joined` takes the flags' items and the variable's together; the rest is pydantic's
    `Field` (constraints such as ge=1, repr=False). Without a default (`...`) the setting is required."""
    extra = {"flag": flag, "metavar": metavar, "env": env, "shown_default": shown_default, "many": many,
             "joined": joined, "separator": separator}
    return Field(default, description=description, json_schema_extra={k: v for k, v in extra.items() if v}, **field)


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def flag_of(name: str, field: FieldInfo) -> str:
    return _extra(field).get("flag") or "--" + name.replace("_", "-")


def env_of(name: str, field: FieldInfo) -> str:
    return _extra(field).get("env") or ENV_PREFIX + flag_of(name, field)[2:].replace("-", "_").upper()


def variables_of(settings: type[Settings]) -> set[str]:
    """The SPLITSERVE_* variables `settings` reads."""
    return {env_of(name, field) for name, field in settings.model_fields.items()}


def _bare(annotation: Any) -> Any:
    """`X` of `X | None` (and of Annotated[X, ...], which pydantic has already unwrapped)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def _many(field: FieldInfo) -> bool:
    return bool(_extra(field).get("many"))


def shown_default(name: str, field: FieldInfo) -> str:
    """How a setting's default is written for people (--help, docs/configuration.md)."""
    shown = _extra(field).get("shown_default")
    if shown:
        return shown
    if field.is_required():
        return "none, required"
    default = field.get_default(call_default_factory=True)
    if isinstance(default, bool):
        return "on" if default else "off"
    return "none" if default in (None, ()) else str(default)


def add_flags(parser: argparse.ArgumentParser, settings: type[Settings]) -> None:
    """One flag per field of `settings`. A flag left out is absent from the parsed namespace (the environment,
    the config file or the default then decides, in `settings_from`)."""
    for name, field in settings.model_fields.items():
        description = field.description or ""
        if "default" not in description:
            description += f" (default: {shown_default(name, field)})"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                                  "help": f"{description} [{env_of(name, field)}]".strip().replace("%", "%%")}
        kind = _bare(field.annotation)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if typing.get_origin(kind) is Literal:
                kwargs["choices"] = [str(choice) for choice in typing.get_args(kind)]
            if _many(field):
                kwargs["action"] = "append"
            kwargs["metavar"] = _extra(field).get("metavar")
        parser.add_argument(flag_of(name, field), **kwargs)


def _from_environment(settings: type[Settings], environ: Mapping[str, str]) -> dict[str, Any]:
    found = {}
    for name, field in settings.model_fields.items():
        text = environ.get(env_of(name, field))
        if text is None or text == "":
            continue
        separator = _extra(field).get("separator") or ","
        found[name] = [part.strip() for part in text.split(separator) if part.strip()] if _many(field) else text
    return found


def _from_file(settings: type[Settings], path: Path) -> dict[str, Any]:
    """A YAML mapping of setting names (as the flags spell them, with or without dashes, or the fields' names)."""
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"config file {path}: {exc}") from None
    if not isinstance(loaded, dict):
        raise SettingsError(f"config file {path}: expected a mapping of settings, got {type(loaded).__name__}")
    names = {flag_of(name, field)[2:].replace("-", "_"): name for name, field in settings.model_fields.items()}
    names.update({name: name for name in settings.model_fields})
    found, unknown = {}, []
    for key, value in loaded.items():
        name = names.get(str(key).replace("-", "_"))
        if name is None:
            unknown.append(str(key))
        else:
            found[name] = value
    if unknown:
        raise SettingsError(f"config file {path}: unknown setting(s) {', '.join(sorted(unknown))}; known: "
                            f"{', '.join(sorted(flag_of(n, f)[2:] for n, f in settings.model_fields.items()))}")
    return found


def settings_from(settings: type[S], args: argparse.Namespace | None = None,
                  config_file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> S:
    """`settings` from the flags in `args` (those given), the environment and `config_file`, in that order of
    precedence; raises SettingsError naming the source of a bad value."""
    given = {name: value for name, value in vars(args or argparse.Namespace()).items() if name in settings.model_fields}
    from_env = _from_environment(settings, os.environ if environ is None else environ)
    from_file = _from_file(settings, Path(config_file)) if config_file else {}
    for name in given.keys() & from_env.keys():
        if _extra(settings.model_fields[name]).get("joined"):
            given[name] = [*given[name], *from_env[name]]
    try:
        return settings(**{**from_file, **from_env, **given})
    except ValidationError as exc:
        raise SettingsError("; ".join(_explain(settings, error, given, from_env, config_file)
                                      for error in exc.errors())) from None


def _explain(settings: type[Settings], error: dict, given: dict, from_env: dict, config_file) -> str:
    name = str(error["loc"][0]) if error["loc"] else ""
    field = settings.model_fields.get(name)
    if field is None:  # a check across settings (a model validator): its own words
        return error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{flag_of(name, field)} is required (or {env_of(name, field)})"
    if name in given:
        where = f"argument {flag_of(name, field)}"
    elif name in from_env:
        where = env_of(name, field)
    else:
        where = f"{config_file}: {name}"
    if error["type"] == "value_error":  # a validator's own words, which name what is wrong
        return f"{where}: {error['msg'].removeprefix('Value error, ')}"
    shown = f" (got {error.get('input')!r})" if field.repr else ""  # a secret's value is never shown
    return f"{where}: {error['msg']}{shown}"


def parse_settings(parser: argparse.ArgumentParser, settings: type[S], argv: list[str] | None = None,
                   environ: Mapping[str, str] | None = None, config_file: str | os.PathLike | None = None) -> S:
    """Parse `argv` with `parser` (which `add_flags` filled from `settings`) into `settings`; a bad setting is a
    usage error (exit 2) naming where it came from, as argparse's own are."""
    args = parser.parse_args(argv)
    try:
        return settings_from(settings, args, config_file, environ)
    except SettingsError as exc:
        parser.error(str(exc))


def default_of(settings: type[Settings], name: str) -> Any:
    """`settings`' default for its field `name`: a settings class that mirrors another's field takes the default
    from there rather than writing it again."""
    return settings.model_fields[name].get_default(call_default_factory=True)


def shown_default_of(settings: type[Settings], name: str) -> str:
    """How --help writes `settings`' default for field `name`, for a setting that mirrors it."""
    return shown_default(name, settings.model_fields[name])


def _secret(field: FieldInfo) -> bool:
    return not field.repr  # such as the API keys: never on a command line (`secret_env`)


def _text(value: Any) -> str:
    """A value as its flag takes it: a whole float without its .0, a sequence as A,B,..."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (list, tuple)):
        return ",".join(_text(item) for item in value)
    return str(value)


def _rendered(name: str, field: FieldInfo, value: Any) -> tuple[str, ...]:
    flag = flag_of(name, field)
    if isinstance(value, bool):
        return (flag,) if value else ("--no-" + flag[2:],)
    if _many(field):
        return tuple(part for item in value for part in (flag, _text(item)))
    return flag, _text(value)


def to_flags(settings: Settings) -> tuple[str, ...]:
    """The command line that parses back into `settings` (`add_flags`, `settings_from`): a flag for each field
    set explicitly or differing from its default, in field order. A secret is left out (`secret_env` carries it);
    so is None, which no flag spells (and which only a default is)."""
    values = settings.model_dump()  # a field's serializer writes it as its flag reads it
    flags: list[str] = []
    for name, field in type(settings).model_fields.items():
        value = values[name]
        if _secret(field) or value is None:
            continue
        if name in settings.model_fields_set or getattr(settings, name) != default_of(type(settings), name):
            flags += _rendered(name, field, value)
    return tuple(flags)


def secret_env(settings: Settings) -> dict[str, str]:
    """The secrets `to_flags` leaves out, as the environment variables that carry them (A,B,... for many)."""
    env = {}
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        if _secret(field) and value:
            env[env_of(name, field)] = _text(value)
    return env
