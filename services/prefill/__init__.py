"""The prefill service: prompt -> KV blocks and first token, shipped to a decode worker."""
