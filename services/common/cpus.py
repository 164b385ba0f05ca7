"""Which CPUs a worker's threads run on: parsing a CPU list, sharing CPUs among workers, binding to them.

Workers that share cores fight: two torch thread pools on the same two cores
each run slower than one pool on one core, and a prefill step stalls the
decode step beside it. `splitserve up` gives each worker its own CPUs
(`share_cpus`), and each worker binds its threads to them (`bind_cpus`) and
runs one torch thread per CPU. A prefill worker's CPUs, idle between prompts,
are lent to its decode worker (`pair_cpu_loans`; `services.common.cpu_loan`).
"""

import os


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6), sorted and without repeats; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (e.g. 0-3,6)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{part!r} in {text!r} counts down")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cpus)


def share_cpus(workers: list[str], cpus: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each worker's CPUs: contiguous, disjoint shares as even as possible (earlier workers get the extra);
    with fewer CPUs than workers, one CPU each, in turn (some are shared)."""
    if not workers or not cpus:
        return {}
    if len(cpus) < len(workers):
        return {w: (cpus[i % len(cpus)],) for i, w in enumerate(workers)}
    share, extra = divmod(len(cpus), len(workers))
    shares, start = {}, 0
    for i, worker in enumerate(workers):
        size = share + (1 if i < extra else 0)
        shares[worker] = cpus[start : start + size]
        start += size
    return shares


_ALLOWED: list[tuple[int, ...]] = []  # what the process could use before `bind_cpus` first narrowed it


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may be moved to: those it could use before `bind_cpus` bound it (its --cpus are
    a share of them), else those it may use now."""
    return _ALLOWED[0] if _ALLOWED else usable_cpus()


def bind_cpus(cpus: tuple[int, ...]) -> None:
    """Run this process's threads (those started from now on, torch's pool included) on `cpus`, one torch
    thread per CPU. Call before the model loads."""
    import torch

    if not _ALLOWED:
        _ALLOWED.append(usable_cpus())
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def pin_threads(cpus: tuple[int, ...]) -> int:
    """Move every thread of this process to `cpus` (a thread started later inherits its starter's: the threads
    are listed again until no new one shows); how many were moved. OSError if the kernel refuses."""
    pinned: set[str] = set()
    while tasks := set(os.listdir("/proc/self/task")) - pinned:
        for task in tasks:
            try:
                os.sched_setaffinity(int(task), cpus)
            except ProcessLookupError:  # ended meanwhile
                pass
        pinned |= tasks
    return len(pinned)


def worker_cpus(spec: str) -> tuple[int, ...]:
    """`splitserve up --cpus`: "auto" (every CPU this process may use), "none" (no binding) or a CPU list
    within those."""
    if spec == "auto":
        return usable_cpus()
    if spec == "none":
        return ()
    cpus = parse_cpu_list(spec)
    outside = sorted(set(cpus) - set(usable_cpus()))
    if outside:
        raise ValueError(f"CPUs {format_cpu_list(tuple(outside))} are not available to this process "
                         f"(it may use {format_cpu_list(usable_cpus())})")
    return cpus


def pair_cpu_loans(lenders: list[str], borrowers: list[str],
                   shares: dict[str, tuple[int, ...]]) -> list[tuple[str, str]]:
    """Which prefill worker (lender) lends its CPU to which decode worker (borrower) while idle: the i-th to
    the i-th, only when every worker has CPUs of its own (a CPU already shared has nothing to lend), and only
    where each of the two has one CPU (the loans `services.common.cpu_loan` runs)."""
    taken = [cpu for cpus in shares.values() for cpu in cpus]
    if len(taken) != len(set(taken)):
        return []
    return [(lender, borrower) for lender, borrower in zip(lenders, borrowers)
            if len(shares.get(lender, ())) == 1 and len(shares.get(borrower, ())) == 1]
