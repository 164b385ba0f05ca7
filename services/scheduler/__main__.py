"""`python -m services.scheduler`: routes requests from the JetStream queue to workers."""

import argparse
import sys

from services.common.options import add_bus_options, run_async


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve scheduler", description="The request scheduler.")
    add_bus_options(parser, "scheduler")
    parser.add_argument("--handoff-timeout", type=float, default=5.0, help="seconds a worker has to take a request")
    return parser


async def serve(args: argparse.Namespace) -> int:
    import asyncio

    from contracts import GenerateRequest, Subjects
    from services.scheduler.router import Router
    from shared.bus.connection import ShutdownSignal, connect, drain
    from shared.bus.registry import Registry
    from shared.bus.service import run_until_stopped
    from shared.bus.subscribe import fetch_loop
    from shared.telemetry.logging import configure_logging, get_logger

    configure_logging("scheduler", args.instance_id, args.log_level)
    log = get_logger("scheduler")
    shutdown = ShutdownSignal()
    subjects = Subjects(args.namespace)
    nc = await connect(args.nats, name=args.instance_id)
    js = nc.jetstream()
    await provision_requests(js, subjects)
    registry = await Registry.open(js, subjects.registry_bucket)
    router = Router(nc=nc, registry=registry, subjects=subjects, instance_id=args.instance_id,
                    handoff_timeout_s=args.handoff_timeout)
    tasks = await router.start()
    consumer = await js.pull_subscribe(subjects.submit, durable=subjects.scheduler_consumer, stream=subjects.requests_stream)
    tasks.append(asyncio.create_task(fetch_loop(consumer, GenerateRequest, router.on_request), name="fetch"))
    log.info("scheduler ready", instance_id=args.instance_id)
    code = await run_until_stopped(*tasks, shutdown=shutdown)
    await router.stop()
    await drain(nc)
    return code


async def provision_requests(js, subjects) -> None:
    """The request queue: work-queue retention, bounded, de-duplicated by request id."""
    from shared.bus.provision import ensure_pull_consumer, ensure_stream

    await ensure_stream(js, name=subjects.requests_stream, subjects=[subjects.submit], retention="workqueue",
                        max_msgs=100_000, max_bytes=1 << 30, max_age_s=600, duplicate_window_s=120)
    await ensure_pull_consumer(js, stream=subjects.requests_stream, durable=subjects.scheduler_consumer,
                               filter_subject=subjects.submit, ack_wait_s=30, max_deliver=5, max_ack_pending=10_000)


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
