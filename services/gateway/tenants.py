"""Who a request is for: the tenant its API key maps to (`services.common.tenant_keys`)."""

import hmac
from collections.abc import Iterable, Mapping

from services.common.tenant_keys import DEFAULT_TENANT, Tenant, read_keys_file, tenant_keys
from services.gateway.edge import presented_key


class TenantDirectory:
    """Finds a request's tenant from its Authorization header, comparing with every key in constant time."""

    def __init__(self, keys: Mapping[str, Tenant]):
        self._keys = [(key.encode(), tenant) for key, tenant in keys.items()]

    @classmethod
    def of(cls, entries: Iterable[str], keys_file: str | None) -> "TenantDirectory":
        return cls(tenant_keys(entries, read_keys_file(keys_file) if keys_file else None))

    @property
    def tenants(self) -> int:
        """How many tenants the keys map to (1 without keys: everyone is one)."""
        return len({tenant.name for _, tenant in self._keys}) or 1

    @property
    def guarded(self) -> bool:
        """Whether requests need a key."""
        return bool(self._keys)

    def tenant_for(self, header: str | None) -> Tenant | None:
        """The tenant of the key the header presents; None: no key, or not one of them. Without keys: default."""
        if not self._keys:
            return DEFAULT_TENANT
        presented = presented_key(header)
        if presented is None:
            return None
        given, found = presented.encode(), None
        for key, tenant in self._keys:  # every key compared: no early exit
            if hmac.compare_digest(given, key) and found is None:
                found = tenant
        return found
