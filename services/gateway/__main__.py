"""`python -m services.gateway`: the OpenAI-compatible HTTP API."""

import argparse
import os
import signal
import sys

from services.common.options import (
    add_bus_options,
    add_model_options,
    bus_credentials,
    bus_tls,
    count,
    env_default,
    positive_seconds,
    resolve_model,
    seconds,
)
from services.gateway.edge import DEFAULT_MAX_REQUEST_BYTES, parse_api_keys
from services.gateway.request_bus import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MIGRATION_LIMIT
from services.gateway.streams import DEFAULT_MAX_WAITING_REQUESTS

DEFAULT_DRAIN_TIMEOUT_S = 10.0


def parse_expect(text: str) -> dict[str, int]:
    """"decode=2,scheduler=1" -> {"decode": 2, "scheduler": 1}."""
    expect = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, _, count = part.partition("=")
        if not role or not count.isdigit():
            raise argparse.ArgumentTypeError(f"expected ROLE=N[,ROLE=N...], got {text!r}")
        expect[role] = int(count)
    return expect


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve gateway", description="The OpenAI-compatible HTTP gateway.")
    add_bus_options(parser, "gateway")
    add_model_options(parser)
    parser.add_argument("--host", default=env_default("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env_default("PORT", 8000)))
    parser.add_argument("--expect", type=parse_expect, default=parse_expect(env_default("EXPECT", "scheduler=1,decode=1")),
                        help="services that must be ready for /health to answer 200, e.g. scheduler=1,decode=2")
    parser.add_argument("--api-key", action="append", metavar="KEY",
                        help="require `Authorization: Bearer KEY` on /v1/* (repeatable; also SPLITSERVE_API_KEY, "
                             "comma-separated, which other local users cannot read from the command line)")
    parser.add_argument("--protect-metrics", action="store_true", help="require an API key on /metrics too")
    parser.add_argument("--max-request-bytes", type=int, default=int(env_default("MAX_REQUEST_BYTES",
                                                                                 DEFAULT_MAX_REQUEST_BYTES)),
                        help="larger request bodies are refused with 413 (default: 4 MiB)")
    parser.add_argument("--migration-limit", type=count, default=int(env_default("MIGRATION_LIMIT",
                                                                                DEFAULT_MIGRATION_LIMIT)),
                        help="times a request moves to another worker, from the tokens its client has, when its "
                             "worker fails or stalls under it (0: it fails instead; default: "
                             f"{DEFAULT_MIGRATION_LIMIT})")
    parser.add_argument("--max-waiting-requests", type=count, default=int(env_default("MAX_WAITING_REQUESTS",
                                                                                     DEFAULT_MAX_WAITING_REQUESTS)),
                        help="admission control: with this many requests still waiting for their first token, a new "
                             "one is refused with 429 and Retry-After before anything is queued (0: no bound; "
                             f"default: {DEFAULT_MAX_WAITING_REQUESTS})")
    parser.add_argument("--stream-idle-timeout", type=positive_seconds,
                        default=float(env_default("STREAM_IDLE_TIMEOUT", DEFAULT_IDLE_TIMEOUT_S)),
                        help="seconds a taken request may go without word from its worker (a token, or the keepalive "
                             "it sends every second) before the worker is taken for stalled and the request moves "
                             f"(default: {DEFAULT_IDLE_TIMEOUT_S:g})")
    parser.add_argument("--drain-timeout", type=seconds, default=float(env_default("DRAIN_TIMEOUT",
                                                                                DEFAULT_DRAIN_TIMEOUT_S)),
                        help="on SIGTERM, seconds the open requests have to finish (new ones get 503) before the "
                             f"rest end with an error event (default: {DEFAULT_DRAIN_TIMEOUT_S:g})")
    parser.add_argument("--chat-template", default=env_default("CHAT_TEMPLATE", None), metavar="FILE|TEMPLATE",
                        help="the chat template to render /v1/chat/completions with instead of the tokenizer's: a "
                             "Jinja file, or the template itself")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    from services.gateway.app import GatewaySettings, create_app
    from services.gateway.server import DrainingServer
    from services.launcher.deployment import RUN_DIR_ENV
    from shared.telemetry.logging import configure_logging
    from shared.telemetry.tracing import configure_tracing

    configure_logging("gateway", args.instance_id, args.log_level)
    configure_tracing("gateway", args.instance_id)
    model_dir, served_name = resolve_model(args)
    from services.gateway.model_info import read_chat_template

    try:
        chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    settings = GatewaySettings(nats_url=args.nats, namespace=args.namespace, instance_id=args.instance_id,
                               model_dir=model_dir, served_model_name=served_name, expect=args.expect,
                               http_port=args.port,
                               api_keys=parse_api_keys(args.api_key, os.environ.get("SPLITSERVE_API_KEY")),
                               protect_metrics=args.protect_metrics, max_request_bytes=args.max_request_bytes,
                               migration_limit=args.migration_limit, max_waiting_requests=args.max_waiting_requests,
                               stream_idle_timeout_s=args.stream_idle_timeout,
                               nats_credentials=bus_credentials(args), nats_tls=bus_tls(args),
                               nats_replicas=args.nats_replicas, chat_template=chat_template,
                               run_dir=os.environ.get(RUN_DIR_ENV))
    # uvicorn re-raises the signal that stopped it into the handler installed before it; a no-op one lets the
    # gateway exit 0 like every service.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    app = create_app(settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop", log_level="warning",
                            timeout_graceful_shutdown=5)
    DrainingServer(config, app.state.gateway, args.drain_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
