"""The scheduler's settings (see `services.common.settings`)."""

from typing import Literal

from services.common.service_settings import Count, NonNegative, PositiveInt, PositiveSeconds, ServiceSettings
from services.common.settings import option

RouterKind = Literal["kv", "load"]


class SchedulerSettings(ServiceSettings):
    ROLE = "scheduler"

    handoff_timeout: PositiveSeconds = option(5.0, "seconds a worker has to take a request", metavar="S")
    max_local_prefill: Count = option(256, "prompts with more uncached tokens than this are prefilled remotely (0: "
                                      "always remote)", metavar="N")
    max_prefill_queue: Count = option(64, "prefill locally when this many prefill jobs are already queued",
                                      metavar="N")
    # Off by default: at 0.5 on 2 cores it cut the worst long-prompt TTFT of the mixed benchmark (12.3 -> 6.6 s)
    # but lengthened its wall time in each of three runs (docs/bench-log/peer-epyc-2026-12-04.md).
    prefill_backlog_factor: NonNegative = option(
        0.0, "prefill a prompt over --max-local-prefill locally when each prefill worker "
        "has more than this many times its uncached tokens queued ahead of it (e.g. 0.5; 0: never; "
        "--max-local-prefill 0 keeps every prompt remote)", metavar="F")
    offload_short_prefills: bool = option(True, "send a prompt within --max-local-prefill to an idle prefill worker "
                                          "too, when its decode worker is busy streaming (computing it there stalls "
                                          "every stream for a step)")
    router: RouterKind = option("kv", "kv: score workers by the prompt prefix their caches hold (from KV "
                                           "events) and their load; load: least loaded first")
    kv_overlap_weight: NonNegative = option(
        2.0, "kv router: weight of a prompt block to compute against a KV block in use", metavar="W")
    prefix_index_blocks: PositiveInt = option(1 << 18, "kv router: block hashes the prefix index keeps at most "
                                              "(least recently used go first; about 360 bytes each)", metavar="N")
