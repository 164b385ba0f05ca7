"""`python -m services.prefill`: one prefill worker."""

import argparse
import sys

from services.common.options import add_bus_options, add_engine_options, add_model_options, engine_config, resolve_model, run_async


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve prefill", description="A prefill worker.")
    add_bus_options(parser, "prefill")
    add_model_options(parser)
    add_engine_options(parser)
    parser.add_argument("--max-concurrent-jobs", type=int, default=8, help="prefill jobs taken at once")
    parser.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "tcp"],
                        help="auto: shared memory when the decode worker is on this host, else TCP")
    return parser


async def serve(args: argparse.Namespace) -> int:
    import asyncio

    from contracts import Subjects
    from services.common.queues import provision_prefill_queue
    from services.prefill.worker import PrefillWorker
    from shared.bus.connection import ShutdownSignal, connect, drain
    from shared.bus.registry import Registry
    from shared.bus.service import run_until_stopped
    from shared.engine.engine import LLMEngine
    from shared.telemetry.logging import configure_logging, get_logger

    configure_logging("prefill", args.instance_id, args.log_level)
    log = get_logger("prefill")
    shutdown = ShutdownSignal()
    subjects = Subjects(args.namespace)
    model_dir, served_name = resolve_model(args)
    engine = await asyncio.to_thread(LLMEngine, engine_config(args, model_dir))
    nc = await connect(args.nats, name=args.instance_id)
    js = nc.jetstream()
    await provision_prefill_queue(js, subjects)
    registry = await Registry.open(js, subjects.registry_bucket)
    worker = PrefillWorker(nc=nc, registry=registry, engine=engine, subjects=subjects, instance_id=args.instance_id,
                           model=model_dir, served_model_name=served_name,
                           max_concurrent_jobs=args.max_concurrent_jobs, kv_transport=args.kv_transport)
    tasks = await worker.start()
    log.info("prefill worker ready", instance_id=args.instance_id)
    code = await run_until_stopped(*tasks, shutdown=shutdown)
    await worker.stop()
    await drain(nc)
    return code


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
