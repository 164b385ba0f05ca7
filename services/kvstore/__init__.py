"""The kv-store: a shared, tiered store of prefix KV blocks keyed by chained block hash (issue 6)."""
