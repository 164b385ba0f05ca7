"""One evaluation of the SLO planner, without I/O: the scraped /metrics text and the launcher's view of the
deployment in; the decision, and the scale that applies it, out. It keeps what spans evaluations: the last scrape
(the next window starts there), the observation history and the policy's state."""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.metrics import PlannerMetrics
from services.planner.observe import History, Pools, Scrape, observe, parse
from services.planner.policy import (SHRINK_AFTER_S, SHRINK_HEADROOM, Decision, Observation, PlannerState, Policy,
                                     Slo, decide)


@dataclass(frozen=True)
class Evaluation:
    observation: Observation
    decision: Decision
    wanted: tuple[int, int] | None  # the change a streak is building towards (None: nothing wanted)

    @property
    def changes(self) -> bool:
        return self.decision.action != "hold"


def pools_of(view: dict) -> Pools:
    """The pool sizes the launcher is keeping (a colocated deployment has no prefill pool)."""
    desired = view.get("desired", {})
    return Pools(prefill=int(desired.get("prefill", 0)), decode=int(desired.get("decode", 0)))


def scaling(view: dict) -> bool:
    """Whether a scale is still under way: workers retiring, or not all started yet."""
    return bool(view.get("retiring")) or view.get("actual") != view.get("desired")


def change_call(decision: Decision, view: dict) -> tuple[str, dict] | None:
    """The control call (route, body) that applies `decision`; None when it holds. A switch is a role switch
    (`POST /v1/switch`) where the deployment allows one (`up --role-switch`): the worker keeps its loaded model.
    Elsewhere it is one `POST /v1/scale` that removes a worker from one pool and adds one to the other, a new
    process loading the model afresh. Every other change is a scale of the deployment's pools."""
    if decision.action == "hold":
        return None
    if decision.action == "switch" and view.get("role_switch"):
        losing, gaining = ("decode", "prefill") if decision.prefill > pools_of(view).prefill else ("prefill", "decode")
        instance = switch_candidate(view, losing)
        if instance is not None:
            return "/v1/switch", {"instance": instance, "to": gaining}
    return "/v1/scale", {role: getattr(decision, role) for role in ("prefill", "decode")
                         if role in view.get("desired", {})}


def switch_candidate(view: dict, role: str) -> str | None:
    """The worker of `role`'s pool to switch: a running one, the last by name (the newest of a pool planned in
    order); None where none runs."""
    running = sorted(name for name, s in view.get("services", {}).items()
                     if s.get("role") == role and s.get("state") == "running")
    return running[-1] if running else None


class Planner:
    def __init__(self, slo: Slo, budget: int, headroom: float, patience: int, cooldown_s: float,
                 metrics: PlannerMetrics | None = None, model_name: str | None = None, *,
                 shrink_headroom: float = SHRINK_HEADROOM, shrink_after_s: float = SHRINK_AFTER_S) -> None:
        self.slo = slo
        self.model_name = model_name  # the model whose pools it plans (None: every series counts)
        self.budget = budget
        self.tuning = {"headroom": headroom, "patience": patience, "cooldown_s": cooldown_s,
                       "shrink_headroom": shrink_headroom, "shrink_after_s": shrink_after_s}
        self.metrics = metrics or PlannerMetrics()
        self.state = PlannerState()
        self.history = History()
        self._last: tuple[float, Scrape] | None = None

    def policy_for(self, pools: Pools) -> Policy:
        return Policy(self.budget, min_prefill=1 if pools.prefill else 0, **self.tuning)

    def evaluate(self, metrics_text: str, view: dict, at_s: float) -> Evaluation | None:
        """This window's evaluation; None for the first scrape (no window yet) and while a scale is under way
        (its window is observed, and no change is decided on it)."""
        scrape = parse(metrics_text, self.model_name)
        last, self._last = self._last, (at_s, scrape)
        if last is None or at_s <= last[0]:
            return None
        pools = pools_of(view)
        obs, self.history = observe(last[1], scrape, at_s - last[0], at_s, pools, self.history)
        if scaling(view):
            return None
        decision, self.state = decide(obs, self.slo, self.policy_for(pools), self.state)
        self.metrics.record(obs, decision)
        return Evaluation(obs, decision, self.state.wanted)
