"""What the gateway's probes say, as Kubernetes expects them.

- `/health` (liveness): the gateway itself works. 200 unless its NATS
  connection is closed for good (a restart is the cure). It also reports the
  deployment: which services are registered ready, which expected ones are
  missing, and which the launcher has marked failed.
- `/ready` (readiness): the gateway can serve now. 200 while NATS is
  connected, the gateway is not draining, and, for one served model at least,
  the services that a request cannot do without are ready; `degraded` (still
  200) when some of the expected rest are missing, or another model cannot be
  served. Each model is judged on its own (`models` in the body): the first by
  `--expect`, every other by `ANOTHER_MODEL_NEEDS`.

The judgement is a pure function of what the registry and the connection say.
"""

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from contracts import ServiceInfo
from services.launcher.deployment import DeploymentError, read_deployment

# A request is served without these: a decode worker prefills itself when no prefill worker can, and computes
# what the kv-store would have lent it.
OPTIONAL_ROLES = frozenset({"prefill", "kvstore"})
# What a model other than the gateway's first needs (the first has --expect): its scheduler, and a worker that
# serves tokens (a decode worker, colocated or not, or a pipeline's head, which registers as one).
ANOTHER_MODEL_NEEDS = {"scheduler": 1, "decode": 1}


def ready_counts(services: Iterable[ServiceInfo]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for entry in services:
        if entry.state == "ready":
            counts[entry.role] = counts.get(entry.role, 0) + 1
    return counts


def needed_to_serve(expect: Mapping[str, int]) -> dict[str, int]:
    """The least of `expect` that serves a request: one of each role, except the optional ones, and every stage
    of a pipeline that decodes (a prefill pipeline's stages, beside a prefill role, are optional with it)."""
    needed = {}
    for role, count in expect.items():
        if count <= 0 or role in OPTIONAL_ROLES:
            continue
        if role == "stage":
            if "prefill" not in expect:
                needed[role] = count
            continue
        needed[role] = 1
    return needed


def missing(counts: Mapping[str, int], wanted: Mapping[str, int]) -> dict[str, int]:
    """How many of each wanted role are short."""
    return {role: n - counts.get(role, 0) for role, n in wanted.items() if counts.get(role, 0) < n}


def judge_model(counts: Mapping[str, int], expect: Mapping[str, int], *, connected: bool) -> dict:
    """One served model's part of /ready: its status ("ready"; "degraded": some expected service is missing;
    "unavailable": none of its requests can be served now, and why), its ready counts and what is missing."""
    body = {"ready": dict(counts), "expected": dict(expect), "missing": missing(counts, expect)}
    if not connected:
        return {"status": "unavailable", "reason": "the gateway is not connected to NATS", **body}
    lacking = missing(counts, needed_to_serve(expect))
    if lacking:
        names = ", ".join(f"{role} ({n} more)" for role, n in lacking.items())
        return {"status": "unavailable", "reason": f"no ready {names}", **body}
    return {"status": "degraded" if body["missing"] else "ready", **body}


def judge_ready(models: Mapping[str, dict], *, connected: bool, draining: bool) -> tuple[int, dict]:
    """/ready's HTTP status and body from each served model's `judge_model`, the first model's counts leading the
    body (as with one model). 200 while one model at least can be served ("ready" once every model has every
    expected service, else "degraded"): a model without workers does not take the others off the load balancer.
    503 while no model can be served, the gateway drains, or its NATS connection is down."""
    first = next(iter(models.values()))
    body = {"ready": first["ready"], "expected": first["expected"], "missing": first["missing"],
            "models": {name: dict(model) for name, model in models.items()}}
    if draining:
        return 503, {"status": "unavailable", "reason": "the gateway is shutting down", **body}
    if not connected:
        return 503, {"status": "unavailable", "reason": "the gateway is not connected to NATS", **body}
    down = {name: model["reason"] for name, model in models.items() if model["status"] == "unavailable"}
    reason = "; ".join(why if len(models) == 1 else f"{name}: {why}" for name, why in down.items())
    if len(down) == len(models):
        return 503, {"status": "unavailable", "reason": reason, **body}
    if down:
        return 200, {"status": "degraded", "reason": reason, **body}
    fully = all(model["status"] == "ready" for model in models.values())
    return 200, {"status": "ready" if fully else "degraded", **body}


def fully_ready(status: int | None, body: str) -> bool:
    """Whether a /ready answer says every expected service is ready (what `splitserve up` waits for)."""
    if status != 200:
        return False
    try:
        return json.loads(body).get("status") == "ready"
    except (ValueError, AttributeError):
        return False


def expected(expect: Mapping[str, int], run_dir: str | None) -> dict[str, int]:
    """`--expect`, with the pool sizes the launcher now wants (deployment.json's `desired`, which `splitserve scale`
    changes) for the roles it names: a scaled deployment is judged by its new sizes."""
    if not run_dir:
        return dict(expect)
    try:
        deployment = read_deployment(Path(run_dir))
    except DeploymentError:
        return dict(expect)
    desired = deployment.desired if deployment is not None else {}
    return {**expect, **{role: n for role, n in desired.items() if role in expect}}


def launcher_failures(run_dir: str | None) -> list[str]:
    """The services the launcher (`splitserve up`, which names its run directory in $SPLITSERVE_RUN_DIR) has
    marked failed; none without a launcher, or when its file cannot be read."""
    if not run_dir:
        return []
    try:
        deployment = read_deployment(Path(run_dir))
    except DeploymentError:  # a damaged file says nothing about the gateway
        return []
    if deployment is None:
        return []
    return [s.name for s in deployment.services if s.state == "failed"]
