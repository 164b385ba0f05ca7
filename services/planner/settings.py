"""The SLO planner's settings (see `services.common.settings`). The policy's tuning takes its defaults from
`services.planner.policy`, so each is written once."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from services.common.service_settings import AnyPort, BusSettings, PositiveInt, PositiveSeconds
from services.common.settings import Settings, default_of, option
from services.planner.policy import COOLDOWN_S, HEADROOM, PATIENCE, SHRINK_AFTER_S, SHRINK_HEADROOM

PositiveMs = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class PlannerSettings(Settings):
    """The SLO planner: every interval it reads the gateway's /metrics and the launcher's pool sizes, and moves
    workers between the decode and prefill pools (within the budget) to keep TTFT and ITL p90 within their SLOs.
    `splitserve up --planner slo` starts it."""

    ROLE: ClassVar[str] = "planner"

    gateway_url: str = option(..., "the gateway whose /metrics it reads, e.g. http://127.0.0.1:8000", metavar="URL")
    control_socket: str = option(..., "the launcher's control API (RUN_DIR/control.sock): the pool sizes, and "
                                 "where a scale is asked", metavar="PATH")
    ttft_slo_ms: PositiveMs = option(..., "time to first token, p90, to keep under", metavar="MS")
    itl_slo_ms: PositiveMs = option(..., "time between tokens, p90, to keep under", metavar="MS")
    budget: PositiveInt = option(..., "workers the prefill and decode pools may hold together (cores, or GPUs, "
                                 "over the workers' share of each)", metavar="N")
    interval_s: PositiveSeconds = option(10.0, "seconds between evaluations: each one observes the window since "
                                         "the last", metavar="S")
    scrape_timeout_s: PositiveSeconds = option(5.0, "deadline of each /metrics scrape and control call",
                                               metavar="S")
    model_name: str | None = option(None, "the served model whose pools it plans: only that model's series count "
                                    "(a deployment serving several models labels each with its model_name)",
                                    metavar="NAME", shown_default="every series")
    dry_run: bool = option(False, "log (and count) what it would do, and change nothing")
    headroom: Annotated[float, Field(gt=0, le=1)] = option(
        HEADROOM, "plan for this share of each SLO, so a change comes before the miss",
        metavar="F")
    shrink_headroom: Annotated[float, Field(gt=0, le=1)] = option(
        SHRINK_HEADROOM, "a pool shrinks only where its figure with fewer workers is predicted within this share of "
        "its SLO (at most --headroom: a removal must not bring the worker back a window later)", metavar="F")
    shrink_after_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = option(
        SHRINK_AFTER_S, "a pool shrinks only once it has wanted fewer workers this long without a break (up fast, "
        "down slowly: a shifting load does not remove a worker it loads again a phase later)", metavar="S")
    patience: PositiveInt = option(PATIENCE, "evaluations in a row that must want the same "
                                   "change before it is made", metavar="N")
    cooldown_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = option(
        COOLDOWN_S, "seconds after a change before the next (its effect needs a window to show)",
        metavar="S")
    metrics_host: str = option("127.0.0.1", "the address its own /metrics listens on")
    metrics_port: AnyPort = option(0, "the port of its own /metrics (0: a free one, logged)", metavar="PORT")
    api_key: str | None = option(None, "a key for a gateway whose /metrics requires one (--protect-metrics)",
                                 metavar="KEY", repr=False)
    instance_id: str = option("planner-0", "its name in logs")
    log_level: Literal["debug", "info", "warning", "error"] = option(default_of(BusSettings, "log_level"),
                                                                      "the lowest level logged")

    @model_validator(mode="after")
    def _shrink_within_headroom(self) -> "PlannerSettings":
        if self.shrink_headroom > self.headroom:
            raise ValueError(f"--shrink-headroom {self.shrink_headroom:g} is over --headroom {self.headroom:g}: a "
                             "pool would shrink where it would grow back")
        return self
