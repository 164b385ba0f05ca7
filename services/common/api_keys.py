"""API keys as the operator gives them: the gateway's, checked by every service's settings."""

from collections.abc import Iterable


def parse_api_keys(flags: Iterable[str] | None, env_value: str | None) -> tuple[str, ...]:
    """Keys from `--api-key` (repeatable) and SPLITSERVE_API_KEY (comma-separated); blanks dropped."""
    keys = [*(flags or ()), *(env_value or "").split(",")]
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))
