"""The scheduler service: routes each request to a worker."""
