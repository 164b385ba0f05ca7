"""What `splitserve scale` may change, and what a change means: pure functions, no processes.

A scale sets a pool's desired size; the launcher then reconciles (`reconcile`): planned instances that do not run
start, running ones no longer planned are retired (SIGTERM: they drain, their streams finish or move). Only the
decode and prefill pools scale so far; a pipeline's stages and the kv-store do not yet.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

SCALABLE = ("decode", "prefill")
NOT_YET = ("stage", "stage-head", "kvstore", "kv-store")  # known pools that do not scale yet
SINGLE = ("gateway", "scheduler")  # one per deployment


class ScaleError(ValueError):
    """A scale that cannot be done, with the reason for the operator."""


def desired_pools(up) -> dict[str, int]:
    """The pools `up`'s settings ask for that scale: decode, and disagg's prefill pool unless it is a pipeline."""
    if up.topology == "pipeline":
        return {}
    pools = {"decode": up.decode}
    if up.topology == "disagg" and up.prefill_stages is None:
        pools["prefill"] = up.prefill
    return pools


def parse_counts(items: list[str]) -> dict[str, int]:
    """["decode=2", "prefill=1"] -> {"decode": 2, "prefill": 1}; ScaleError on a malformed item."""
    counts: dict[str, int] = {}
    for item in items:
        role, eq, count = item.partition("=")
        if not eq or not role or not count.strip().lstrip("-").isdigit():
            raise ScaleError(f"{item!r} is not ROLE=N (e.g. decode=2)")
        if role in counts:
            raise ScaleError(f"{role} is given twice")
        counts[role] = int(count)
    if not counts:
        raise ScaleError("say which pools to scale: ROLE=N ... (e.g. decode=2)")
    return counts


def check_scale(counts: Mapping[str, object], topology: str, prefill_pipeline: bool) -> dict[str, int]:
    """The counts, checked against what this deployment can scale; ScaleError names the first problem."""
    checked: dict[str, int] = {}
    for role, count in counts.items():
        if role in NOT_YET:
            raise ScaleError(f"{role} workers do not scale yet (only {' and '.join(SCALABLE)} do)")
        if role in SINGLE:
            raise ScaleError(f"{role} does not scale: a deployment runs one")
        if role not in SCALABLE:
            raise ScaleError(f"unknown role {role!r} (the pools that scale: {', '.join(SCALABLE)})")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ScaleError(f"{role}={count}: a pool keeps at least 1 worker")
        if topology == "pipeline":
            raise ScaleError("--topology pipeline runs one pipeline: its pools do not scale yet")
        if role == "prefill" and topology != "disagg":
            raise ScaleError(f"--topology {topology} has no prefill pool")
        if role == "prefill" and prefill_pipeline:
            raise ScaleError("the prefill pool is one pipeline (--prefill-stages): it does not scale yet")
        checked[role] = count
    return checked


def reconcile(planned: Collection[str], running: Collection[str], retiring: Collection[str]) -> tuple[list[str], list[str]]:
    """(to start, to retire) among a scalable pool's instances: planned ones neither running nor still retiring
    start (a name still retiring waits until it is gone); running ones no longer planned retire."""
    start = [name for name in planned if name not in running and name not in retiring]
    retire = [name for name in running if name not in planned]
    return start, retire


def pool_sizes(roles: Mapping[str, str], retiring: Collection[str]) -> dict[str, int]:
    """Instances per scalable role, of `roles` (name -> role), not counting retiring ones."""
    sizes = {role: 0 for role in SCALABLE if role in roles.values()}
    for name, role in roles.items():
        if role in sizes and name not in retiring:
            sizes[role] += 1
    return sizes
