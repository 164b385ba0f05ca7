"""The SLO planner's policy: from what the pools did over the last window, how many prefill and decode workers the
deployment should have within its budget, and whether to change now. Pure: no I/O and no clock (the time comes
in the observation), so every decision can be replayed from its inputs.

The model behind it (after DistServe's and Dynamo's planners): a prefill pool of n workers, each computing C
prompt tokens per second, fed L tokens per second, is a queue with utilisation rho = L / (n C); a prompt of P
tokens waits for the backlog B to drain, then takes P / C, both stretched by 1 / (1 - rho) under load:
TTFT(n) ~ (B / (n C) + P / C) / (1 - rho). A decode pool of n workers sharing S running sequences steps every
ITL(n) ~ fixed + per_seq * S / n milliseconds (a linear fit of the workers' own step times). Each pool gets the
fewest workers whose predicted figure stays within its SLO times `headroom`; where the model and the measured
p90 disagree, the measurement wins (a miss adds a worker even if the model says enough). A pool shrinks only
where its figure with fewer workers is predicted within the narrower `shrink_headroom` (hysteresis: a pool left
near its target by a removal would want the worker back a window later). When the budget cannot hold both, it
is split to keep the worse of the two ratios (predicted / SLO) smallest.

Changes (`decide`): up fast, down slowly, as Kubernetes' autoscaler stabilises its scale-down. A pool grows after
`patience` evaluations want it; it shrinks only once it has wanted fewer workers for `shrink_after_s` without a
break (a shifting load would otherwise remove a worker in one phase and load it again, a model load, in the
next). A pool that needs a worker while the other has one it does not need takes that one (a switch: no model
to load where the deployment switches roles) rather than a new one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    itl_ms: float


@dataclass(frozen=True)
class PrefillPool:
    """The prefill workers over the window (workers 0: a colocated deployment, whose decode workers prefill)."""

    workers: int
    tokens_per_s: float  # prompt tokens arriving for the pool per second
    capacity_per_worker: float  # prompt tokens a busy worker computes per second (0: not measured yet)
    mean_prompt_tokens: float  # uncached tokens of a prompt, on average
    queued_tokens: int = 0  # waiting now, over the pool


@dataclass(frozen=True)
class DecodePool:
    workers: int
    running: int  # sequences decoding now, over the pool
    step_ms_fixed: float  # the step-time fit: fixed + per_seq * sequences in the step (fixed 0: not measured yet)
    step_ms_per_seq: float


@dataclass(frozen=True)
class Observation:
    at_s: float  # when (any monotonic clock, the same for every observation)
    prefill: PrefillPool
    decode: DecodePool
    ttft_p90_ms: float | None = None  # measured over the window (None: no request finished one)
    itl_p90_ms: float | None = None


# The tuning's defaults (the planner's settings take theirs from here).
HEADROOM = 0.8
SHRINK_HEADROOM = 0.5
PATIENCE = 3
COOLDOWN_S = 30.0
SHRINK_AFTER_S = 60.0
CORRECTION_LIMIT = 4.0  # the measurement moves the model's figures by this factor at most, either way


@dataclass(frozen=True)
class Policy:
    budget: int  # workers the pools may hold together (cores, or GPUs)
    min_prefill: int = 1  # 0 for a colocated deployment
    min_decode: int = 1
    headroom: float = HEADROOM  # plan for this share of each SLO, so a change comes before the miss
    patience: int = PATIENCE  # consecutive evaluations wanting the same change before it is made
    cooldown_s: float = COOLDOWN_S  # after a change, the next waits this long (its effect needs a window to show)
    shrink_headroom: float = SHRINK_HEADROOM  # a pool shrinks only to what is predicted within this share of the SLO
    shrink_after_s: float = SHRINK_AFTER_S  # ... and only once it has wanted fewer workers this long without a break

    def __post_init__(self) -> None:
        if self.min_prefill < 0 or self.min_decode < 1 or self.budget < self.min_prefill + self.min_decode:
            raise ValueError(f"a budget of {self.budget} cannot hold {self.min_prefill} prefill and "
                             f"{self.min_decode} decode workers")
        if not 0 < self.headroom <= 1 or self.patience < 1 or self.cooldown_s < 0 or self.shrink_after_s < 0:
            raise ValueError("headroom is in (0, 1], patience at least 1, cooldown_s and shrink_after_s at least 0")
        if not 0 < self.shrink_headroom <= self.headroom:
            raise ValueError("shrink_headroom is in (0, headroom]")


@dataclass(frozen=True)
class PlannerState:
    """What the planner remembers between evaluations."""

    wanted: tuple[int, int] | None = None  # the change (prefill, decode) the streak is for
    streak: int = 0
    last_change_s: float = -math.inf
    fewer_since: tuple[float | None, float | None] = (None, None)  # since when each pool has wanted fewer workers


@dataclass(frozen=True)
class Decision:
    prefill: int  # the workers each pool should have now
    decode: int
    action: str  # "hold", "add", "remove" or "switch" (a worker changes role: one pool's loss is the other's gain)
    reason: str  # one line, for the log and the metric's label (its first word)


def predicted_ttft_ms(pool: PrefillPool, workers: int) -> float:
    """TTFT with `workers` in the pool (inf where the load exceeds what they compute)."""
    if workers <= 0 or pool.capacity_per_worker <= 0:
        return math.inf
    capacity = workers * pool.capacity_per_worker
    rho = pool.tokens_per_s / capacity
    if rho >= 1:
        return math.inf
    seconds = pool.queued_tokens / capacity + pool.mean_prompt_tokens / pool.capacity_per_worker
    return 1000 * seconds / (1 - rho)


def predicted_itl_ms(pool: DecodePool, workers: int) -> float:
    if workers <= 0 or pool.step_ms_fixed <= 0:
        return math.inf
    return pool.step_ms_fixed + pool.step_ms_per_seq * pool.running / workers


def correction(measured_ms: float | None, predicted_now_ms: float) -> float:
    """How far the model is off where the pool is now: measured p90 / predicted, within [1/CORRECTION_LIMIT,
    CORRECTION_LIMIT]; 1 where either is missing. Every prediction of the pool is scaled by it (Dynamo's planner
    corrects its profiled estimates the same way), so the model says how the figure moves with the workers and
    the measurement says where it stands."""
    if measured_ms is None or measured_ms <= 0 or not 0 < predicted_now_ms < math.inf:
        return 1.0
    return min(max(measured_ms / predicted_now_ms, 1 / CORRECTION_LIMIT), CORRECTION_LIMIT)


def predictors(obs: Observation):
    """(ttft(n), itl(n)): each pool's model, corrected by its measurement (`correction`)."""
    p, d = obs.prefill, obs.decode
    ttft_k = correction(obs.ttft_p90_ms, predicted_ttft_ms(p, p.workers))
    itl_k = correction(obs.itl_p90_ms, predicted_itl_ms(d, d.workers))
    return (lambda n: predicted_ttft_ms(p, n) * ttft_k), (lambda n: predicted_itl_ms(d, n) * itl_k)


def _fewest(predict, target_ms: float, low: int, high: int) -> int:
    """The fewest workers in [low, high] predicted within target_ms (high when none is)."""
    for n in range(low, high + 1):
        if predict(n) <= target_ms:
            return n
    return high


def _pool_want(now: int, model_want: int, measured_ms: float | None, slo_ms: float, policy: Policy,
               name: str, predict) -> tuple[int, str]:
    """The model's want, corrected by the measurement: a measured miss adds a worker even where the model says
    enough, and a pool whose measured figure is past the headroom does not shrink; a pool shrinks only as far as
    the prediction stays within the shrink headroom."""
    headroom = policy.headroom
    if measured_ms is not None and measured_ms > slo_ms:
        return max(model_want, now + 1), f"{name} p90 {measured_ms:.0f} ms over its slo of {slo_ms:g}"
    if measured_ms is not None and measured_ms > slo_ms * headroom and model_want < now:
        return now, ""
    target = slo_ms * headroom
    if model_want > now:
        return model_want, f"{name} predicted {predict(now):.0f} ms with {now}, over {target:g}"
    if model_want < now:
        shrink_target = slo_ms * policy.shrink_headroom
        fewer = next((n for n in range(model_want, now) if predict(n) <= shrink_target), now)
        if fewer == now:
            return now, ""
        return fewer, f"{name} predicted {predict(fewer):.0f} ms with {fewer}, within {shrink_target:g}"
    return model_want, ""


def _needed(obs: Observation, slo: Slo, policy: Policy) -> tuple[int, int, str]:
    """Each pool's want on its own (ignoring the other's), and why."""
    p, d = obs.prefill, obs.decode
    ttft, itl = predictors(obs)
    why = []
    want_p, want_d = p.workers, d.workers
    if policy.min_prefill == 0 and p.workers == 0:
        want_p = 0  # colocated: the decode workers prefill
    elif p.capacity_per_worker <= 0:
        why.append("prefill not measured yet")
    else:
        model = _fewest(ttft, slo.ttft_ms * policy.headroom, max(policy.min_prefill, 1),
                        policy.budget - policy.min_decode)
        want_p, said = _pool_want(p.workers, model, obs.ttft_p90_ms, slo.ttft_ms, policy, "ttft", ttft)
        why.append(said)
    if d.step_ms_fixed <= 0:
        why.append("decode not measured yet")
    else:
        model = _fewest(itl, slo.itl_ms * policy.headroom, policy.min_decode, policy.budget - policy.min_prefill)
        want_d, said = _pool_want(d.workers, model, obs.itl_p90_ms, slo.itl_ms, policy, "itl", itl)
        why.append(said)
    return want_p, want_d, "; ".join(filter(None, why))


def _split(obs: Observation, slo: Slo, policy: Policy) -> tuple[int, int]:
    """The whole budget shared so that the worse of the two predicted/SLO ratios is smallest (ties: as now)."""
    ttft, itl = predictors(obs)

    def worse(n_p: int) -> tuple[float, int]:
        return max(ttft(n_p) / slo.ttft_ms, itl(policy.budget - n_p) / slo.itl_ms), abs(n_p - obs.prefill.workers)

    best = min(range(max(policy.min_prefill, 1), policy.budget - policy.min_decode + 1), key=worse)
    return best, policy.budget - best


def desired(obs: Observation, slo: Slo, policy: Policy) -> tuple[int, int, str]:
    """The (prefill, decode) workers that would meet both SLOs within the budget, and why (before hysteresis)."""
    want_p, want_d, why = _needed(obs, slo, policy)
    want_p, want_d = max(policy.min_prefill, want_p), max(policy.min_decode, want_d)
    if want_p + want_d <= policy.budget:
        return want_p, want_d, why or "slo met"
    if obs.prefill.capacity_per_worker <= 0 or obs.decode.step_ms_fixed <= 0:
        return obs.prefill.workers, obs.decode.workers, why  # nothing to weigh the pools by yet
    split_p, split_d = _split(obs, slo, policy)
    return split_p, split_d, "budget shared" + (f"; {why}" if why else "")


def _step_towards(now: int, want: int) -> int:
    """One worker at a time: each change is watched for a window before the next."""
    return now + (want > now) - (want < now)


def _action(prefill_delta: int, decode_delta: int) -> str:
    if prefill_delta * decode_delta < 0:
        return "switch"
    if prefill_delta > 0 or decode_delta > 0:
        return "add"
    return "remove" if prefill_delta < 0 or decode_delta < 0 else "hold"


def _fewer_since(since: tuple[float | None, float | None], now: tuple[int, int], want: tuple[int, int],
                 at_s: float) -> tuple[float | None, float | None]:
    """Since when each pool has wanted fewer workers than it has, without a break (None: it does not now)."""
    prefill, decode = ((since[i] if since[i] is not None else at_s) if want[i] < now[i] else None for i in range(2))
    return prefill, decode


def _target(now: tuple[int, int], want: tuple[int, int], ripe: tuple[bool, bool], policy: Policy) -> tuple[int, int]:
    """Where this evaluation moves the pools (one worker each at most), before patience and cooldown: a pool
    that grows takes a worker the other does not want first; a pool shrinks only once its want is `ripe`."""
    (now_p, now_d), (want_p, want_d) = now, want
    spare_p, spare_d = want_p < now_p and now_p > policy.min_prefill, want_d < now_d and now_d > policy.min_decode
    if want_p > now_p and spare_d:
        return now_p + 1, now_d - 1
    if want_d > now_d and spare_p:
        return now_p - 1, now_d + 1
    target = tuple(_step_towards(now[i], want[i]) if want[i] >= now[i] or ripe[i] else now[i] for i in range(2))
    if sum(target) > policy.budget:  # one pool grows while the other has not shrunk yet: move a worker across
        across = (now_p + 1, now_d - 1) if target[0] > now_p else (now_p - 1, now_d + 1)
        return across if across[0] >= policy.min_prefill and across[1] >= policy.min_decode else now
    return target  # type: ignore[return-value]


def decide(obs: Observation, slo: Slo, policy: Policy, state: PlannerState) -> tuple[Decision, PlannerState]:
    """This evaluation's decision and the state the next one starts from. A change is made after `patience`
    evaluations in a row wanted it, and not within `cooldown_s` of the last; it moves each pool one worker; a
    pool shrinks only after wanting to for `shrink_after_s`."""
    now = now_p, now_d = obs.prefill.workers, obs.decode.workers
    want_p, want_d, why = desired(obs, slo, policy)
    since = _fewer_since(state.fewer_since, now, (want_p, want_d), obs.at_s)
    state = replace(state, fewer_since=since)
    ripe = tuple(s is not None and obs.at_s - s >= policy.shrink_after_s for s in since)
    target = _target(now, (want_p, want_d), ripe, policy)  # type: ignore[arg-type]
    if now_p + now_d > policy.budget:  # over budget (the budget shrank): give back first, decode last
        target = (now_p - 1, now_d) if now_p > policy.min_prefill else (now_p, now_d - 1)
        why = f"over the budget of {policy.budget}"
    elif target == now and any(s is not None for s in since):
        waited = max(obs.at_s - s for s in since if s is not None)
        why = "; ".join(filter(None, (why, f"fewer wanted for {waited:.0f} s of {policy.shrink_after_s:g}")))
    hold = Decision(now_p, now_d, "hold", why or "slo met")
    if target == now:
        return hold, replace(state, wanted=None, streak=0)
    streak = state.streak + 1 if state.wanted == target else 1
    if streak < policy.patience:
        return replace(hold, reason=f"waiting ({streak}/{policy.patience}): {why}"), replace(
            state, wanted=target, streak=streak)
    if obs.at_s - state.last_change_s < policy.cooldown_s:
        return replace(hold, reason=f"cooling down: {why}"), replace(state, wanted=target, streak=streak)
    action = _action(target[0] - now_p, target[1] - now_d)
    return Decision(target[0], target[1], action, why), PlannerState(last_change_s=obs.at_s)
