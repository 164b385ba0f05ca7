"""`python -m services.prefill`: one prefill worker."""

import argparse
import sys

from services.common.options import (
    add_bus_options,
    add_side_channel_options,
    transfer_tls_of,
    add_cpu_loan_options,
    apply_engine_placement,
    add_engine_options,
    add_kv_store_options,
    add_model_options,
    engine_config,
    resolve_model,
    run_async,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve prefill", description="A prefill worker.")
    add_bus_options(parser, "prefill")
    add_side_channel_options(parser)
    add_model_options(parser)
    add_engine_options(parser)
    parser.add_argument("--max-concurrent-jobs", type=int, default=8, help="prefill jobs taken at once")
    parser.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "tcp"],
                        help="auto: shared memory when the decode worker is on this host, else TCP")
    add_kv_store_options(parser)
    add_cpu_loan_options(parser, borrower=False)
    return parser


async def serve(args: argparse.Namespace) -> int:
    from services.common.cpu_loan import cpu_share_from_args
    from services.common.queues import provision_prefill_queue
    from services.common.engine_thread import EngineThread
    from services.common.runner import run_service
    from services.common.kv_memory import kv_cache_allocator
    from services.common.engine_worker import EngineWorker
    from services.prefill.worker import PrefillRole
    from shared.engine.engine import LLMEngine

    model_dir, served_name = resolve_model(args)
    tls = transfer_tls_of(args)

    async def build(nc, js, registry, subjects, replicas):
        cpu_share = cpu_share_from_args(args)  # before loading: its CPUs are not lent while it loads
        engine_thread = EngineThread()
        engine = await engine_thread.run(LLMEngine, engine_config(args, model_dir),
                                         kv_allocator=kv_cache_allocator(args.kv_transport, args.device))
        await provision_prefill_queue(js, subjects, replicas)
        worker = EngineWorker(nc=nc, registry=registry, subjects=subjects, engine=engine, engine_thread=engine_thread,
                              instance_id=args.instance_id, role="prefill", model=model_dir,
                              served_model_name=served_name, cpu_share=cpu_share)
        worker.role = PrefillRole(worker, max_concurrent_jobs=args.max_concurrent_jobs, kv_transport=args.kv_transport,
                                  transfer_tls=tls)
        if args.kv_store:
            from services.common.kvstore_tier import start_kv_store_tier

            worker.kv_store = await start_kv_store_tier(args, nc=nc, subjects=subjects, registry=registry,
                                                         engine=engine, engine_loop=worker.engine_loop)
        return worker

    return await run_service(args, "prefill", build)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_engine_placement(args)
    return run_async(serve(args))


if __name__ == "__main__":
    sys.exit(main())
