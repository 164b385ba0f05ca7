"""The decode service: continuous-batching generation over paged KV (colocated mode also prefills)."""
