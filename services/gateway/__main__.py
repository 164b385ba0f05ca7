"""`python -m services.gateway`: the OpenAI-compatible HTTP API."""

import argparse
import os
import signal
import sys

from services.common.options import bus_credentials, bus_tls, resolve_model
from services.common.settings import add_flags, parse_settings
from services.gateway.settings import GatewayServiceSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve gateway", description="The OpenAI-compatible HTTP gateway.")
    add_flags(parser, GatewayServiceSettings)
    return parser


def settings_of(argv: list[str] | None = None, environ=None) -> GatewayServiceSettings:
    return parse_settings(build_parser(), GatewayServiceSettings, argv, environ)


def main(argv: list[str] | None = None) -> int:
    settings = settings_of(argv)
    import uvicorn

    from services.gateway.app import GatewayConfig, create_app
    from services.gateway.server import DrainingServer
    from services.launcher.deployment import RUN_DIR_ENV
    from shared.telemetry.logging import configure_logging
    from shared.telemetry.tracing import configure_tracing

    configure_logging("gateway", settings.instance_id, settings.log_level)
    configure_tracing("gateway", settings.instance_id)
    model_dir, served_name = resolve_model(settings)
    from services.gateway.model_info import read_chat_template

    try:
        chat_template = read_chat_template(settings.chat_template) if settings.chat_template else None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    config = GatewayConfig(nats_url=settings.nats, namespace=settings.namespace, instance_id=settings.instance_id,
                           model_dir=model_dir, served_model_name=served_name, expect=settings.expect,
                           http_port=settings.port, api_keys=settings.api_keys, protect_metrics=settings.protect_metrics,
                           share_prefix_cache=settings.share_prefix_cache,
                           max_request_bytes=settings.max_request_bytes,
                           body_timeout_s=settings.request_body_timeout, migration_limit=settings.migration_limit,
                           max_waiting_requests=settings.max_waiting_requests,
                           stream_idle_timeout_s=settings.stream_idle_timeout,
                           nats_credentials=bus_credentials(settings), nats_tls=bus_tls(settings),
                           nats_replicas=settings.nats_replicas, chat_template=chat_template,
                           run_dir=os.environ.get(RUN_DIR_ENV))
    # uvicorn re-raises the signal that stopped it into the handler installed before it; a no-op one lets the
    # gateway exit 0 like every service.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    app = create_app(config)
    server = uvicorn.Config(app, host=settings.host, port=settings.port, loop="uvloop", log_level="warning",
                            timeout_graceful_shutdown=5)
    DrainingServer(server, app.state.gateway, settings.drain_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
