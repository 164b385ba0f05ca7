"""NATS runtime shared by every service: connection, provisioning, registry, actors, typed subscriptions."""
