"""`up --planner slo`: whether this deployment can have a planner, its budget, and its service spec. Pure."""

from __future__ import annotations

import math

from services.common.api_keys import key_of

from services.common.settings import default_of
from services.launcher.topology import ServiceSpec, http_url
from services.launcher.up_settings import UpSettings
from services.planner.settings import PlannerSettings

NAME = default_of(PlannerSettings, "instance_id")


def workers_started(up: UpSettings) -> int:
    """The prefill and decode workers `up` starts (a prefill pipeline counts as none: it does not scale)."""
    prefill = up.prefill if up.topology == "disagg" and up.prefill_stages is None else 0
    return up.decode + prefill


def check_planner(up: UpSettings) -> None:
    """ValueError unless `up`'s planner settings make sense together."""
    if up.planner == "none":
        given = [flag for flag, value in (("--ttft-slo-ms", up.ttft_slo_ms), ("--itl-slo-ms", up.itl_slo_ms),
                                          ("--planner-budget", up.planner_budget)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} set the SLO planner's targets: they need --planner slo")
        return
    if up.topology == "pipeline":
        raise ValueError("--planner slo moves workers between the prefill and decode pools; --topology pipeline "
                         "has one pool, its pipelines (`splitserve scale decode=N` sizes it)")
    if up.ttft_slo_ms is None or up.itl_slo_ms is None:
        raise ValueError("--planner slo needs both SLOs: --ttft-slo-ms MS and --itl-slo-ms MS")
    if up.planner_budget is not None and up.planner_budget < workers_started(up):
        raise ValueError(f"--planner-budget {up.planner_budget} is less than the {workers_started(up)} prefill and "
                         "decode workers `up` starts")


def default_budget(up: UpSettings, cpus: tuple[int, ...], cpu_count: int) -> int:
    """The workers the pools may hold together when --planner-budget is not given: on CPUs one per CPU the
    workers are placed on (`cpus`; every one of `cpu_count` where the OS places them), since a worker runs a
    torch thread per CPU and fewer than one each only time-slices; on GPUs 1 / --gpu-memory-utilization per GPU
    the pools use (without a share, what `up` starts: nothing known to grow into). Never fewer than `up` starts."""
    started = workers_started(up)
    devices = {up.decode_device or up.device} | ({up.prefill_device or up.device} if started > up.decode else set())
    gpus = devices - {"cpu"}
    if not gpus:
        return max(started, len(cpus) or cpu_count)
    if up.gpu_memory_utilization is None:
        return started
    return max(started, math.floor(1 / up.gpu_memory_utilization + 1e-9) * len(gpus))


def planner_spec(up: UpSettings, gateway_url: str, control_socket: str, budget: int, port: int,
                 model_name: str) -> ServiceSpec:
    """The planner's service: it reads `gateway_url`'s /metrics (the series of `model_name`, the first model:
    its pools are the ones it moves) and scales through `control_socket`."""
    assert up.ttft_slo_ms is not None and up.itl_slo_ms is not None
    api_key = key_of(up.api_keys[0]) if up.protect_metrics and up.api_keys else None  # (KEY of KEY:TENANT)
    settings = PlannerSettings(gateway_url=gateway_url, control_socket=control_socket, ttft_slo_ms=up.ttft_slo_ms,
                               itl_slo_ms=up.itl_slo_ms, budget=budget, dry_run=up.planner_dry_run,
                               interval_s=up.planner_interval_s, metrics_port=port, api_key=api_key,
                               model_name=model_name)
    return ServiceSpec(NAME, settings, url=http_url(settings.metrics_host, port) + "/metrics")
