"""CPUs for workers added to a running deployment, leaving the running ones theirs: pure.

The running workers keep the CPUs they were started with (re-pinning them is another piece of work); a new one
gets CPUs no worker has, split evenly among the new ones, and only when none is free the CPU the fewest workers
share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from services.common.cpus import share_cpus


def place_new_workers(taken: Mapping[str, tuple[int, ...]], new: list[str],
                      cpus: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each new worker's CPUs, out of `cpus`, given the running workers' (`taken`); none without CPUs to share."""
    if not new or not cpus:
        return {}
    use = Counter(cpu for held in taken.values() for cpu in held if cpu in cpus)
    free = tuple(cpu for cpu in cpus if cpu not in use)
    if len(free) >= len(new):
        return share_cpus(new, free)
    placed: dict[str, tuple[int, ...]] = {}
    for name in new:
        if free:
            cpu, free = free[0], free[1:]
        else:
            cpu = min(cpus, key=lambda c: (use[c], c))  # the least shared
        use[cpu] += 1
        placed[name] = (cpu,)
    return placed
