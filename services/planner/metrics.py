"""The planner's own Prometheus series: what it wants, every decision (by action and the first word of its
reason, a bounded set), and the figures it decided on."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from services.planner.policy import Decision, Observation, predictors

ROLES = ("prefill", "decode")


def reason_label(reason: str) -> str:
    """The first word of a decision's reason: "ttft", "itl", "slo", "waiting", "cooling", "budget", ..."""
    words = reason.split()
    return words[0].strip(":;,()").lower() if words else "none"


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("splitserve_planner_desired_workers", "Workers the planner wants in each pool now",
                             ["role"], registry=r)
        self.decisions = Counter("splitserve_planner_decisions", "The planner's evaluations, by the action decided "
                                 "(hold, add, remove, switch) and the first word of its reason", ["action", "reason"],
                                 registry=r)
        self.applied = Counter("splitserve_planner_scales", "Scales the planner asked of the launcher, by outcome "
                               "(ok, refused, failed; dry_run: not asked)", ["outcome"], registry=r)
        self.failures = Counter("splitserve_planner_failures", "Evaluations skipped: a scrape or control call that "
                                "failed or passed its deadline", ["call"], registry=r)
        self.figures = Gauge("splitserve_planner_observed", "What the last evaluation observed and predicted "
                             "(NaN: not measured)", ["figure"], registry=r)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: a free port); the port."""
        server, _ = start_http_server(port, host, registry=self.registry)
        return server.server_port

    def record(self, obs: Observation, decision: Decision) -> None:
        self.decisions.labels(decision.action, reason_label(decision.reason)).inc()
        self.desired.labels("prefill").set(decision.prefill)
        self.desired.labels("decode").set(decision.decode)
        for name, value in figures_of(obs, decision).items():
            self.figures.labels(name).set(math.nan if value is None or math.isinf(value) else value)


def figures_of(obs: Observation, decision: Decision) -> dict[str, float | None]:
    """The observed and predicted figures of an evaluation, by name (the gauge's `figure` label, and the log's)."""
    p, d = obs.prefill, obs.decode
    ttft, itl = predictors(obs)  # as the policy predicts: the model, corrected by the measurement
    return {
        "ttft_p90_ms": obs.ttft_p90_ms, "itl_p90_ms": obs.itl_p90_ms,
        "predicted_ttft_ms": ttft(decision.prefill) if p.workers else None,
        "predicted_itl_ms": itl(decision.decode),
        "prefill_tokens_per_s": p.tokens_per_s, "prefill_capacity_per_worker": p.capacity_per_worker,
        "mean_prompt_tokens": p.mean_prompt_tokens, "queued_prompt_tokens": p.queued_tokens,
        "running_sequences": d.running, "step_ms_fixed": d.step_ms_fixed, "step_ms_per_seq": d.step_ms_per_seq,
    }
