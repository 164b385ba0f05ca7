"""The cache salt the gateway gives each request: prefix reuse stays within a tenant.

A prompt's block hashes start from its salt (`shared.engine.block_hash`), so
two tenants' identical prompts share no cached block anywhere, and a tenant's
`cached_tokens` says nothing of another's prompts. The tenant is the API key
the request came with; with no keys configured, or with `--share-prefix-cache`,
everyone is one tenant. A client's own `cache_salt` (vLLM's field) narrows its
reuse further: it is mixed with the tenant's, never used in its place.
"""

import hashlib
import hmac

_CONTEXT = b"splitserve cache salt/1"


def tenant_salt(api_key: str) -> str:
    """HMAC keyed by the API key: it never travels, and nobody without it can make its salt. The same on every
    gateway of the deployment (and after a restart), so a tenant's prefixes are found wherever it lands."""
    return hmac.new(api_key.encode(), _CONTEXT, hashlib.sha256).hexdigest()[:32]


def cache_salt(api_key: str | None, requested: str | None) -> str:
    """The salt of a request from `api_key` (None: everyone is one tenant) asking for salt `requested`."""
    tenant = tenant_salt(api_key) if api_key else ""
    if not requested:
        return tenant
    return hashlib.blake2b(f"{tenant}\0{requested}".encode(), digest_size=16, person=b"client-salt").hexdigest()
