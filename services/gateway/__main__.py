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

    from services.gateway.app import BusAccess, create_app
    from services.gateway.server import DrainingServer
    from services.launcher.deployment import RUN_DIR_ENV
    from shared.telemetry.logging import configure_logging
    from shared.telemetry.tracing import configure_tracing

    configure_logging("gateway", settings.instance_id, settings.log_level)
    configure_tracing("gateway", settings.instance_id)
    model_dir, served_name = resolve_model(settings)
    # The model as a directory: a known model's name is resolved once, here.
    settings = settings.model_copy(update={"model": model_dir, "served_model_name": served_name})
    bus = BusAccess(bus_credentials(settings), bus_tls(settings))
    # uvicorn re-raises the signal that stopped it into the handler installed before it; a no-op one lets the
    # gateway exit 0 like every service.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        app = create_app(settings, bus, run_dir=os.environ.get(RUN_DIR_ENV))
    except (OSError, ValueError) as exc:  # a --chat-template that is neither a file nor a template, say
        raise SystemExit(f"error: {exc}") from None
    server = uvicorn.Config(app, host=settings.host, port=settings.port, loop="uvloop", log_level="warning",
                            timeout_graceful_shutdown=5)
    DrainingServer(server, app.state.gateway, settings.drain_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
