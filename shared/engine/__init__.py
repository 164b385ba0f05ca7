"""The model runner every splitserve worker embeds (no NATS in here)."""
