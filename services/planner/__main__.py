"""`python -m services.planner`: the SLO planner of one deployment (`splitserve up --planner slo` starts it).

Not a bus service: it reads the gateway's /metrics over HTTP and the launcher's control API on its Unix socket,
and serves its own /metrics."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import urllib.error
import urllib.request

from services.common.settings import add_flags, parse_settings
from services.planner.settings import PlannerSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve planner",
                                     description="The SLO planner: moves workers between a deployment's prefill "
                                     "and decode pools to keep TTFT and ITL within their SLOs.")
    add_flags(parser, PlannerSettings)
    return parser


def settings_of(argv: list[str] | None = None, environ=None) -> PlannerSettings:
    return parse_settings(build_parser(), PlannerSettings, argv, environ)


def calls_of(settings: PlannerSettings):
    """The planner's two calls on the real deployment, each with the scrape deadline."""
    from services.launcher.control_client import ControlUnavailable, call
    from services.planner.loop import CallFailed, Calls

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    timeout_s = settings.scrape_timeout_s

    def metrics() -> str:
        request = urllib.request.Request(settings.gateway_url.rstrip("/") + "/metrics", headers=headers)
        try:
            with opener.open(request, timeout=timeout_s) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise CallFailed("scrape", f"GET {request.full_url}: {getattr(exc, 'reason', exc)}") from None

    def control(method: str, route: str, body: object) -> tuple[int, dict]:
        try:
            return call(settings.control_socket, method, route, body, timeout_s=timeout_s)
        except (ControlUnavailable, OSError) as exc:
            raise CallFailed("control", f"{method} {route}: {exc}") from None

    return Calls(metrics, control)


def main(argv: list[str] | None = None) -> int:
    from services.planner.loop import run
    from services.planner.metrics import PlannerMetrics
    from services.planner.planner import Planner
    from services.planner.policy import Slo
    from shared.telemetry.logging import configure_logging, get_logger

    settings = settings_of(argv)
    configure_logging("planner", settings.instance_id, settings.log_level)
    log = get_logger("planner")
    metrics = PlannerMetrics()
    try:
        port = metrics.serve(settings.metrics_host, settings.metrics_port)
    except OSError as exc:
        log.error("planner: cannot serve /metrics", host=settings.metrics_host, port=settings.metrics_port,
                  error=str(exc))
        return 1
    planner = Planner(Slo(settings.ttft_slo_ms, settings.itl_slo_ms), settings.budget, settings.headroom,
                      settings.patience, settings.cooldown_s, metrics, settings.model_name,
                      shrink_headroom=settings.shrink_headroom, shrink_after_s=settings.shrink_after_s)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("planner ready", metrics=f"http://{settings.metrics_host}:{port}/metrics", budget=settings.budget,
             ttft_slo_ms=settings.ttft_slo_ms, itl_slo_ms=settings.itl_slo_ms, interval_s=settings.interval_s,
             dry_run=settings.dry_run)
    run(planner, calls_of(settings), settings.interval_s, settings.dry_run, stop)
    log.info("planner stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
