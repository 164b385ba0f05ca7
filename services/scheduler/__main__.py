"""`python -m services.scheduler`: routes requests from the JetStream queue to workers."""

import argparse
import sys

from services.common.options import run_async
from services.common.settings import add_flags, parse_settings
from services.scheduler.settings import SchedulerSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve scheduler", description="The request scheduler.")
    add_flags(parser, SchedulerSettings)
    return parser


def settings_of(argv: list[str] | None = None, environ=None) -> SchedulerSettings:
    return parse_settings(build_parser(), SchedulerSettings, argv, environ)


async def serve(settings: SchedulerSettings) -> int:
    from services.common.runner import run_service
    from services.scheduler.request_loop import Router

    async def build(nc, js, registry, subjects, replicas):
        return Router(nc=nc, registry=registry, subjects=subjects, instance_id=settings.instance_id,
                      handoff_timeout_s=settings.handoff_timeout, max_local_prefill=settings.max_local_prefill,
                      max_prefill_queue=settings.max_prefill_queue, offload_short_prefills=settings.offload_short_prefills,
                      prefill_backlog_factor=settings.prefill_backlog_factor,
                      router=settings.router,
                      overlap_weight=settings.kv_overlap_weight, max_index_blocks=settings.prefix_index_blocks)

    return await run_service(settings, "scheduler", build)


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(settings_of(argv)))


if __name__ == "__main__":
    sys.exit(main())
