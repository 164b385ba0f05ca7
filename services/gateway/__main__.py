"""`python -m services.gateway`: the OpenAI-compatible HTTP API."""

import argparse
import os
import signal
import sys

from services.common.options import bus_credentials, bus_tls, resolve_model, resolve_model_dir
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

    from services.gateway.also_serve import AlsoServe
    from services.gateway.app import create_app
    from services.gateway.model_backend import BusAccess
    from services.gateway.server import DrainingServer
    from services.launcher.deployment import RUN_DIR_ENV
    from shared.telemetry.logging import configure_logging
    from shared.telemetry.tracing import configure_tracing

    configure_logging("gateway", settings.instance_id, settings.log_level)
    configure_tracing("gateway", settings.instance_id)
    model_dir, served_name = resolve_model(settings)
    also = tuple(AlsoServe(other.name, resolve_model_dir(other.model), other.namespace) for other in settings.also_serve)
    # The models as directories: a known model's name is resolved once, here.
    settings = settings.model_copy(update={"model": model_dir, "served_model_name": served_name, "also_serve": also})
    bus = BusAccess(bus_credentials(settings), bus_tls(settings))
    # uvicorn re-raises the signal that stopped it into the handler installed before it; a no-op one lets the
    # gateway exit 0 like every service.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        app = create_app(settings, bus, run_dir=os.environ.get(RUN_DIR_ENV))
    except (OSError, ValueError) as exc:  # a --chat-template that is neither a file nor a template, a name twice
        raise SystemExit(f"error: {exc}") from None
    server = uvicorn.Config(app, host=settings.host, port=settings.port, loop="uvloop", log_level="warning",
                            timeout_graceful_shutdown=5)
    DrainingServer(server, app.state.gateway, settings.drain_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
