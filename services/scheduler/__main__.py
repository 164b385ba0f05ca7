"""`python -m services.scheduler`: routes requests from the JetStream queue to workers."""

import argparse
import sys

from services.common.options import add_bus_options, run_async


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve scheduler", description="The request scheduler.")
    add_bus_options(parser, "scheduler")
    parser.add_argument("--handoff-timeout", type=float, default=5.0, help="seconds a worker has to take a request")
    parser.add_argument("--max-local-prefill", type=int, default=256,
                        help="prompts with more uncached tokens than this are prefilled remotely (0: always remote)")
    parser.add_argument("--max-prefill-queue", type=int, default=64,
                        help="prefill locally when this many prefill jobs are already queued")
    return parser


async def serve(args: argparse.Namespace) -> int:
    import asyncio

    from contracts import GenerateRequest, Subjects
    from services.common.queues import provision_request_queue
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
    await provision_request_queue(js, subjects)
    registry = await Registry.open(js, subjects.registry_bucket)
    router = Router(nc=nc, registry=registry, subjects=subjects, instance_id=args.instance_id,
                    handoff_timeout_s=args.handoff_timeout, max_local_prefill=args.max_local_prefill,
                    max_prefill_queue=args.max_prefill_queue)
    tasks = await router.start()
    consumer = await js.pull_subscribe(subjects.submit, durable=subjects.scheduler_consumer, stream=subjects.requests_stream)
    tasks.append(asyncio.create_task(fetch_loop(consumer, GenerateRequest, router.on_request), name="fetch"))
    log.info("scheduler ready", instance_id=args.instance_id)
    code = await run_until_stopped(*tasks, shutdown=shutdown)
    await router.stop()
    await drain(nc)
    return code


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
