"""API keys as the operator gives them: the gateway's, checked by every service's settings.

An entry is `KEY` (the key is a tenant of its own, named by `key_id`) or `KEY:TENANT` (split at the last colon;
several keys may name one tenant). A key holding a colon is given with its tenant, or in a keys file.
"""

import hashlib
import hmac
import re
from collections.abc import Iterable

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_ID_CONTEXT = b"splitserve key id/1"


def parse_api_keys(flags: Iterable[str] | None, env_value: str | None) -> tuple[str, ...]:
    """Keys from `--api-key` (repeatable) and SPLITSERVE_API_KEY (comma-separated); blanks dropped."""
    keys = [*(flags or ()), *(env_value or "").split(",")]
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def key_id(key: str) -> str:
    """A short name for a key that is not the key: logs and metric labels name a key's own tenant by it."""
    return "key-" + hmac.new(_KEY_ID_CONTEXT, key.encode(), hashlib.sha256).hexdigest()[:12]


def split_key_entry(entry: str) -> tuple[str, str | None]:
    """`KEY:TENANT` -> (KEY, TENANT); `KEY` -> (KEY, None). ValueError (never naming the key) when malformed."""
    key, colon, tenant = entry.rpartition(":")
    if not colon:
        return entry, None
    if not key:
        raise ValueError("an --api-key entry has an empty key before its ':TENANT'")
    if not TENANT_NAME.match(tenant):
        raise ValueError(f"tenant name {tenant!r} of an --api-key entry: use 1-64 letters, digits, '.', '_' or '-'")
    return key, tenant


def key_of(entry: str) -> str:
    """The key an entry presents (`Authorization: Bearer KEY`)."""
    return split_key_entry(entry)[0]
