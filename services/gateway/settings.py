"""The gateway's settings (see `services.common.settings`); `__main__` resolves them into the `GatewayConfig` the
app runs with."""

from typing import Annotated, Any

from pydantic import BeforeValidator

from services.common.service_settings import (
    ApiKeys,
    BusSettings,
    Count,
    ModelSettings,
    Port,
    PositiveInt,
    PositiveSeconds,
    Seconds,
)
from services.common.settings import option
from services.gateway.edge import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from services.gateway.request_bus import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MIGRATION_LIMIT
from services.gateway.streams import DEFAULT_MAX_WAITING_REQUESTS

DEFAULT_DRAIN_TIMEOUT_S = 10.0


def parse_expect(value: Any) -> Any:
    """"decode=2,scheduler=1" -> {"decode": 2, "scheduler": 1}."""
    if not isinstance(value, str):
        return value
    expect = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        role, _, count = part.partition("=")
        if not role or not count.isdigit():
            raise ValueError(f"expected ROLE=N[,ROLE=N...], got {value!r}")
        expect[role] = int(count)
    return expect


class GatewayServiceSettings(ModelSettings, BusSettings):
    ROLE = "gateway"

    host: str = option("127.0.0.1", "the address the HTTP API listens on", metavar="ADDR")
    port: Port = option(8000, "the HTTP API's port")
    expect: Annotated[dict[str, int], BeforeValidator(parse_expect)] = option(
        {"scheduler": 1, "decode": 1}, "services that must be ready for /ready to answer 200", metavar="ROLE=N,...",
        shown_default="scheduler=1,decode=1")
    api_keys: ApiKeys = option((), "require `Authorization: Bearer KEY` on /v1/* (repeatable; the variable "
                                       "takes KEY,KEY,..., which other local users cannot read as they can a flag; "
                                       "the keys of both count)",
                                       flag="--api-key", metavar="KEY", env="SPLITSERVE_API_KEY", many=True, joined=True,
                                       repr=False)
    protect_metrics: bool = option(False, "require an API key on /metrics too")
    share_prefix_cache: bool = option(False, "requests of different API keys reuse each other's cached prompt "
                                      "prefixes (by default each key's are its own: a shared prefix's "
                                      "cached_tokens would tell one tenant what another asked)")
    max_request_bytes: PositiveInt = option(DEFAULT_MAX_REQUEST_BYTES, "larger request bodies are refused with 413",
                                            metavar="N", shown_default=f"{DEFAULT_MAX_REQUEST_BYTES >> 20} MiB")
    request_body_timeout: PositiveSeconds = option(DEFAULT_BODY_TIMEOUT_S, "seconds a client has to send a "
                                                   "request's body; a slower one gets 408 and its connection closes",
                                                   metavar="S")
    migration_limit: Count = option(DEFAULT_MIGRATION_LIMIT, "times a request moves to another worker, from the "
                                    "tokens its client has, when its worker fails or stalls under it (0: it fails "
                                    "instead)", metavar="N")
    max_waiting_requests: Count = option(DEFAULT_MAX_WAITING_REQUESTS, "admission control: with this many requests "
                                         "still waiting for their first token, a new one is refused with 429 and "
                                         "Retry-After before anything is queued (0: no bound)", metavar="N")
    stream_idle_timeout: PositiveSeconds = option(DEFAULT_IDLE_TIMEOUT_S, "seconds a taken request may go without "
                                                  "word from its worker (a token, or the keepalive it sends every "
                                                  "second) before the worker is taken for stalled and the request "
                                                  "moves", metavar="S")
    drain_timeout: Seconds = option(DEFAULT_DRAIN_TIMEOUT_S, "on SIGTERM, seconds the open requests have to finish "
                                    "(new ones get 503) before the rest end with an error event", metavar="S")
    chat_template: str | None = option(None, "the chat template to render /v1/chat/completions with instead of the "
                                       "tokenizer's: a Jinja file, or the template itself", metavar="FILE|TEMPLATE")
