"""API keys to tenants, each with its limits: the gateway's (`services.gateway.tenants`), checked by settings.

Keys come from `--api-key KEY[:TENANT]` (see `services.common.api_keys`) and from `--api-keys-file FILE`, YAML
or JSON, which can set each tenant's limits too:

    tenants:
      acme: {max_in_flight: 8, tokens_per_minute: 60000, priority: 1}
    keys:
      - {key: sk-acme-1, tenant: acme}
      - {key: sk-solo}            # a tenant of its own, as --api-key KEY

The file holds secrets: one readable or writable by group or others is refused. Errors name the entry, never
its key. Without any key every request is the one tenant `default`, without limits.
"""

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.api_keys import TENANT_NAME, key_id, split_key_entry
from shared.engine import MAX_PRIORITY


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    max_in_flight: int = 0  # requests admitted and not finished, at most (0: no limit)
    tokens_per_minute: int = 0  # prompt and completion tokens, as a token bucket (0: no limit)
    priority: int = 0  # higher goes first when requests wait


DEFAULT_TENANT = Tenant("default")


class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_in_flight: int = Field(0, ge=0)
    tokens_per_minute: int = Field(0, ge=0)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = Field(min_length=1)
    tenant: str | None = Field(None, pattern=TENANT_NAME.pattern)


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenants: dict[str, _Limits] = {}
    keys: list[_KeyEntry] = []


@dataclass(frozen=True)
class KeysFile:
    limits: dict[str, Tenant]  # tenant name -> its limits
    keys: list[tuple[str, str | None]]  # (key, tenant or None: its own)


def _describe(error: ValidationError) -> str:
    """pydantic's errors without their input (which may be a key)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'the file'}: {e['msg']}"
                     for e in error.errors(include_input=False, include_url=False))


def parse_keys_file(text: str, json_format: bool = False) -> KeysFile:
    """The keys file's content; ValueError naming what is wrong."""
    try:
        document = json.loads(text) if json_format else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"not valid {'JSON' if json_format else 'YAML'}: {str(exc).splitlines()[0]}") from None
    try:
        parsed = _KeysFile.model_validate(document or {})
    except ValidationError as exc:
        raise ValueError(_describe(exc)) from None
    for name in parsed.tenants:
        if not TENANT_NAME.match(name):
            raise ValueError(f"tenants.{name}: use 1-64 letters, digits, '.', '_' or '-'")
    limits = {name: Tenant(name, **entry.model_dump()) for name, entry in parsed.tenants.items()}
    return KeysFile(limits, [(entry.key, entry.tenant) for entry in parsed.keys])


def read_keys_file(path: str) -> KeysFile:
    """The keys file at `path`, refused unless only its owner may read and write it."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_IMODE(mode) & 0o077:
            raise ValueError(f"{path} holds API keys and is open to group or others (mode {stat.S_IMODE(mode):o}); "
                             f"chmod 600 {path}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return parse_keys_file(text, json_format=path.endswith(".json"))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def tenant_keys(entries: Iterable[str], keys_file: KeysFile | None = None) -> dict[str, Tenant]:
    """Each key's tenant, from `--api-key` entries and a keys file; ValueError for a key given two tenants."""
    limits = dict(keys_file.limits) if keys_file else {}
    pairs = [split_key_entry(e) for e in entries] + (keys_file.keys if keys_file else [])
    named: dict[str, str] = {}
    for key, tenant in pairs:
        name = tenant or key_id(key)
        if named.setdefault(key, name) != name:
            raise ValueError(f"API key {key_id(key)} is given two tenants, {named[key]!r} and {name!r}")
    return {key: limits.get(name) or Tenant(name) for key, name in named.items()}
