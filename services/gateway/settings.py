"""The gateway's settings (see `services.common.settings`); the app runs with them (`services.gateway.app`)."""

from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, model_validator

from services.common.service_settings import (
    ApiKeys,
    ApiKeysFile,
    BusSettings,
    Count,
    ModelSettings,
    Port,
    PositiveInt,
    PositiveSeconds,
    Seconds,
)
from services.common.settings import option
from services.gateway.also_serve import AlsoServe, check_served_models, parse_also_serve


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


def expect_text(counts: dict[str, int]) -> str:
    """{"decode": 2, "scheduler": 1} -> "decode=2,scheduler=1" (what `parse_expect` reads)."""
    return ",".join(f"{role}={n}" for role, n in counts.items())


def parse_also_serve_all(values: Any) -> Any:
    if isinstance(values, (list, tuple)):
        return tuple(parse_also_serve(value) for value in values)
    return values


AlsoServeList = Annotated[tuple[AlsoServe, ...], BeforeValidator(parse_also_serve_all),
                          PlainSerializer(lambda models: [str(model) for model in models])]


class GatewayServiceSettings(ModelSettings, BusSettings):
    ROLE = "gateway"

    host: str = option("127.0.0.1", "the address the HTTP API listens on", metavar="ADDR")
    port: Port = option(8000, "the HTTP API's port")
    expect: Annotated[dict[str, int], BeforeValidator(parse_expect), PlainSerializer(expect_text)] = option(
        {"scheduler": 1, "decode": 1}, "services that must be ready for /ready to answer 200", metavar="ROLE=N,...",
        shown_default="scheduler=1,decode=1")
    api_keys: ApiKeys = option((), "require `Authorization: Bearer KEY` on /v1/* (repeatable; KEY:TENANT names "
                                   "its tenant, several keys may share one; a bare KEY is a tenant of its own; the "
                                   "variable takes KEY,KEY,..., which other local users cannot read as they can a "
                                   "flag; the keys of both count)",
                                   flag="--api-key", metavar="KEY[:TENANT]", env="SPLITSERVE_API_KEY", many=True,
                                   joined=True, repr=False)
    keys_file: ApiKeysFile = option(None, "API keys and their tenants' limits (max_in_flight, "
                                        "tokens_per_minute, priority), YAML or JSON (docs/security.md); refused when "
                                        "group or others may read it", flag="--api-keys-file", metavar="FILE")
    protect_metrics: bool = option(False, "require an API key on /metrics too")
    share_prefix_cache: bool = option(False, "requests of different tenants reuse each other's cached prompt "
                                      "prefixes (by default each tenant's are its own: a shared prefix's "
                                      "cached_tokens would tell one tenant what another asked)")
    max_request_bytes: PositiveInt = option(4 << 20, "larger request bodies are refused with 413",
                                            metavar="N", shown_default="4 MiB")
    # 4 MiB at 1 Mbit/s, with room.
    request_body_timeout: PositiveSeconds = option(30.0, "seconds a client has to send a "
                                                   "request's body; a slower one gets 408 and its connection closes",
                                                   metavar="S")
    migration_limit: Count = option(3, "times a request moves to another worker, from the "
                                    "tokens its client has, when its worker fails or stalls under it (0: it fails "
                                    "instead)", metavar="N")
    max_waiting_requests: Count = option(256, "admission control: with this many requests to a model "
                                         "still waiting for their first token, a new one to it is refused with 429 and "
                                         "Retry-After before anything is queued (0: no bound); and each tenant's room in "
                                         "the fair queue", metavar="N")
    max_dispatched: Count = option(8, "requests sent on to a model's workers without a first token yet, at most, "
                                   "but for a tenant under its share of them (N over the tenants sending, rounded "
                                   "up), which may go past it; the others wait here in per-tenant fair queues, the "
                                   "highest priority first, then fair shares of tokens (0: no bound, first come "
                                   "first served; with one tenant there is no bound: nobody to be fair to)",
                                   metavar="N")
    queue_timeout: PositiveSeconds = option(30.0, "seconds a request may wait here for its turn before 429",
                                            metavar="S")
    # A taken request's worker sends a token or a StreamAlive at least every second (services.decode.worker).
    stream_idle_timeout: PositiveSeconds = option(5.0, "seconds a taken request may go without "
                                                  "word from its worker (a token, or the keepalive it sends every "
                                                  "second) before the worker is taken for stalled and the request "
                                                  "moves", metavar="S")
    drain_timeout: Seconds = option(10.0, "on SIGTERM, seconds the open requests have to finish "
                                    "(new ones get 503) before the rest end with an error event", metavar="S")
    chat_template: str | None = option(None, "the chat template to render /v1/chat/completions with instead of the "
                                       "tokenizer's: a Jinja file, or the template itself", metavar="FILE|TEMPLATE")
    also_serve: AlsoServeList = option((), "also serve the model NAME=MODEL@NAMESPACE: route requests for NAME "
                                       "to the scheduler and workers in NAMESPACE (a namespace of its own), its "
                                       "tokenizer, chat template and context read from MODEL (a directory, or "
                                       "whatever --model takes)", flag="--also-serve",
                                       metavar="NAME=MODEL@NAMESPACE", env="SPLITSERVE_ALSO_SERVE", many=True)

    @model_validator(mode="after")
    def _models_apart(self) -> "GatewayServiceSettings":
        check_served_models(self.served_model_name, self.namespace, self.also_serve)
        return self
