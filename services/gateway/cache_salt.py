"""The cache salt the gateway gives each request: prefix reuse stays within a tenant.

A prompt's block hashes start from its salt (`shared.engine.block_hash`), so
two tenants' identical prompts share no cached block anywhere, and a tenant's
`cached_tokens` says nothing of another's prompts. The tenant is the one its
API key maps to (`services.gateway.tenants`): keys of one tenant share their
prefixes. With no keys configured, or with `--share-prefix-cache`, everyone is
one tenant. A client's own `cache_salt` (vLLM's field) narrows its reuse
further: it is mixed with the tenant's, never used in its place.
"""

import hashlib
import hmac

_CONTEXT = b"splitserve cache salt/2"


def tenant_salt(tenant: str) -> str:
    """The tenant's salt: the same on every gateway of the deployment (and after a restart), so a tenant's
    prefixes are found wherever it lands. A client never sees it, and its own salt is mixed in, never used
    alone, so no client can make another tenant's."""
    return hmac.new(tenant.encode(), _CONTEXT, hashlib.sha256).hexdigest()[:32]


def cache_salt(tenant: str | None, requested: str | None) -> str:
    """The salt of a request of `tenant` (None: everyone is one tenant) asking for salt `requested`."""
    base = tenant_salt(tenant) if tenant else ""
    if not requested:
        return base
    return hashlib.blake2b(f"{base}\0{requested}".encode(), digest_size=16, person=b"client-salt").hexdigest()
