"""What `splitserve switch` may do, and which workers each pool plans once workers have switched: pure functions.

A switch moves one running worker from one scalable pool to the other on its loaded engine
(`services.common.role_switch`); the launcher then counts it in its new pool (desired and actual), so a later
scale neither undoes nor double-counts it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from services.launcher.scale_policy import WORKER_POOLS, ScaleError


def check_switch(body: object, *, topology: str, prefill_pipeline: bool, role_switch: bool,
                 roles: Mapping[str, str], retiring: Collection[str]) -> tuple[str, str]:
    """(instance, new role) of a `{"instance": ID, "to": ROLE}` switch, checked against the deployment: `roles`,
    each running scalable service's role now (the workers' count); ScaleError names the first problem."""
    if not isinstance(body, dict) or not isinstance(body.get("instance"), str) or not isinstance(body.get("to"), str):
        raise ScaleError('the body is {"instance": ID, "to": "prefill"|"decode"}')
    instance, to = body["instance"], body["to"]
    if topology != "disagg" or prefill_pipeline:
        raise ScaleError("only a disagg deployment (without --prefill-stages) switches workers between its pools")
    if not role_switch:
        raise ScaleError("role switching is not enabled: start the deployment with `splitserve up --role-switch`")
    if to not in WORKER_POOLS:
        raise ScaleError(f"a worker switches to {' or '.join(WORKER_POOLS)}, not {to!r}")
    roles = {name: role for name, role in roles.items() if role in WORKER_POOLS}  # a kv-store does not switch
    if instance not in roles:
        raise ScaleError(f"no running decode or prefill worker is named {instance!r} (see `splitserve ps`)")
    if instance in retiring:
        raise ScaleError(f"{instance} is retiring")
    current = roles[instance]
    if current == to:
        raise ScaleError(f"{instance} is {to} already")
    if sum(1 for name, role in roles.items() if role == current and name not in retiring) <= 1:
        raise ScaleError(f"{instance} is the last {current} worker: a pool keeps at least 1")
    return instance, to


def planned_names(desired: Mapping[str, int], plan: Mapping[str, Sequence[str]], roles: Mapping[str, str]) -> list[str]:
    """The workers each pool is to have: first those serving as its role now (`roles`: every running or retiring
    worker's role now; its own planned names first, in plan order, then those switched into it), then its plan's
    names (`plan`, long enough) that no worker holds, up to its desired size."""
    names: list[str] = []
    for role, count in desired.items():
        order = {name: i for i, name in enumerate(plan.get(role, ()))}
        members = sorted((n for n, r in roles.items() if r == role), key=lambda n: (n not in order, order.get(n, 0), n))
        free = [n for n in plan.get(role, ()) if n not in roles]
        names += (members + free)[:count]
    return names
