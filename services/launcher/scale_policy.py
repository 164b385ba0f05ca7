"""What `splitserve scale` may change, and what a change means: pure functions, no processes.

A scale sets a pool's desired size; the launcher then reconciles (`reconcile`): planned instances that do not run
start, running ones no longer planned are retired (SIGTERM: they drain, their streams finish or move). The decode
and prefill pools scale, and the kv-stores (rendezvous hashing gives each block to one of those up: one that joins
takes over its share, one that leaves costs its blocks' misses). A pipeline deployment's decode pool is its pipelines:
each is a head (which takes requests as a decode worker) and its stages, started stages first and retired head first
(its streams drain or move; its stages go once it is gone). A pipeline's stages do not scale on their own, nor does
disagg's pipelined prefill pool (--prefill-stages).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

WORKER_POOLS = ("decode", "prefill")  # the model's workers: placed on CPUs, switchable between the two
SCALABLE = (*WORKER_POOLS, "kvstore")
PIPELINE_PARTS = ("stage", "stage-head")  # a pipeline's parts: they scale as whole pipelines
SINGLE = ("gateway", "scheduler")  # one per deployment


POOL_SETTING = {"decode": "decode", "prefill": "prefill", "kvstore": "kv_stores"}  # up's setting of each pool's size


class ScaleError(ValueError):
    """A scale that cannot be done, with the reason for the operator."""


def desired_pools(up) -> dict[str, int]:
    """The pools `up`'s settings ask for that scale: decode, disagg's prefill pool unless it is a pipeline, and the
    kv-stores where it runs them."""
    pools = {"decode": up.decode}
    if up.topology == "pipeline":
        return pools
    if up.topology == "disagg" and up.prefill_stages is None:
        pools["prefill"] = up.prefill
    if up.runs_kv_store:
        pools["kvstore"] = up.kv_stores
    return pools


def sized(up, desired: Mapping[str, int]):
    """`up`'s settings with its pools at the `desired` sizes."""
    return up.model_copy(update={POOL_SETTING[role]: count for role, count in desired.items()})


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


def check_scale(counts: Mapping[str, object], topology: str, prefill_pipeline: bool,
                kv_store: bool = False) -> dict[str, int]:
    """The counts, checked against what this deployment (`kv_store`: which runs kv-stores) can scale; ScaleError
    names the first problem."""
    checked: dict[str, int] = {}
    for role, count in counts.items():
        if role in PIPELINE_PARTS:
            raise ScaleError(f"a pipeline's {role} workers do not scale on their own: a pipeline deployment scales "
                             "whole pipelines (decode=N runs N, each a head and its stages)")
        if role in SINGLE:
            raise ScaleError(f"{role} does not scale: a deployment runs one")
        if role not in SCALABLE:
            raise ScaleError(f"unknown role {role!r} (the pools that scale: {', '.join(SCALABLE)})")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ScaleError(f"{role}={count}: a pool keeps at least 1 worker")
        if role == "prefill" and topology != "disagg":
            raise ScaleError(f"--topology {topology} has no prefill pool")
        if role == "prefill" and prefill_pipeline:
            raise ScaleError("the prefill pool is one pipeline (--prefill-stages): it does not scale")
        if role == "kvstore" and not kv_store:
            raise ScaleError("this deployment runs no kv-store (up's --kv-store starts one)")
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
