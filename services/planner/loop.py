"""The planner's loop: every interval, read the launcher's view and the gateway's /metrics, evaluate, and apply
the decision with a scale (unless a dry run). The calls are given to it (`Calls`), each with its own deadline; a
failed one is logged and counted, and the loop goes on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.planner.planner import Evaluation, Planner, change_call
from shared.telemetry.logging import get_logger

log = get_logger("planner")


class CallFailed(Exception):
    """A scrape or control call that failed or passed its deadline; `call` says which ("scrape", "control")."""

    def __init__(self, call: str, message: str) -> None:
        super().__init__(message)
        self.call = call


@dataclass(frozen=True)
class Calls:
    metrics: Callable[[], str]  # the gateway's /metrics text
    control: Callable[[str, str, object], tuple[int, dict]]  # (method, route, body) -> (status, answer)


def describe(ev: Evaluation) -> str:
    """One line: what the pools are and become (or would), and why."""
    obs, d = ev.observation, ev.decision
    sizes = f"prefill {obs.prefill.workers} -> {d.prefill}, decode {obs.decode.workers} -> {d.decode}"
    if ev.changes:
        return f"{d.action}: {sizes}: {d.reason}"
    wants = f" (wants prefill {ev.wanted[0]}, decode {ev.wanted[1]})" if ev.wanted else ""
    return f"hold{wants}: {d.reason}"


def tick(planner: Planner, calls: Calls, at_s: float, dry_run: bool) -> Evaluation | None:
    """One evaluation, applied; None where nothing was decided."""
    try:
        status, view = calls.control("GET", "/v1/deployment", None)
        if status != 200:
            raise CallFailed("control", f"GET /v1/deployment answered {status}: {view.get('error', view)}")
        text = calls.metrics()
    except CallFailed as exc:
        planner.metrics.failures.labels(exc.call).inc()
        log.warning("planner: no evaluation this round", call=exc.call, error=str(exc))
        return None
    ev = planner.evaluate(text, view, at_s)
    if ev is None or not (ev.changes or ev.wanted):
        return ev
    call = change_call(ev.decision, view)
    log.info(("would " if dry_run and call else "") + describe(ev), action=ev.decision.action,
             reason=ev.decision.reason, dry_run=dry_run, ttft_p90_ms=ev.observation.ttft_p90_ms,
             itl_p90_ms=ev.observation.itl_p90_ms, call=call[0] if call else None)
    if call is None:
        return ev
    if dry_run:
        planner.metrics.applied.labels("dry_run").inc()
        return ev
    route, body = call
    try:
        status, answer = calls.control("POST", route, body)
    except CallFailed as exc:
        planner.metrics.applied.labels("failed").inc()
        log.warning("planner: the change failed", route=route, body=body, error=str(exc))
        return ev
    outcome = "ok" if status == 200 else "refused"
    planner.metrics.applied.labels(outcome).inc()
    if status != 200:
        log.warning("planner: the launcher refused the change", route=route, body=body, status=status,
                    error=answer.get("error"))
    return ev

def run(planner: Planner, calls: Calls, interval_s: float, dry_run: bool, stop: threading.Event,
        clock: Callable[[], float] = time.monotonic) -> None:
    """Evaluate every `interval_s` until `stop` is set."""
    while not stop.is_set():
        started = clock()
        tick(planner, calls, started, dry_run)
        stop.wait(max(0.0, interval_s - (clock() - started)))
