"""`python -m services.decode`: one decode worker."""

import argparse
import sys

from services.common.options import (
    add_bus_options,
    add_side_channel_options,
    side_channel_address,
    transfer_tls_of,
    add_cpu_loan_options,
    apply_engine_placement,
    add_kv_store_options,
    add_engine_options,
    add_model_options,
    engine_config,
    env_default,
    resolve_model,
    run_async,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve decode", description="A decode worker.")
    add_bus_options(parser, "decode")
    add_side_channel_options(parser)
    add_model_options(parser)
    add_engine_options(parser)
    parser.add_argument("--mode", default="colocated", choices=["colocated", "disagg"],
                        help="colocated: prefills every request itself; disagg: long prompts are prefilled remotely")
    parser.add_argument("--max-active-requests", type=int, default=512, help="running plus queued requests taken at most")
    parser.add_argument("--kv-receiver-host", default=env_default("KV_RECEIVER_HOST", None),
                        help="address the KV side channel listens on (disagg mode; default: --advertise-host's)")
    parser.add_argument("--kv-receiver-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--kv-receiver-advertise", default=env_default("KV_RECEIVER_ADVERTISE", None),
                        help="the address prefill workers dial (needed when listening on 0.0.0.0)")
    add_kv_store_options(parser)
    add_cpu_loan_options(parser, borrower=True)
    parser.add_argument("--prefill-timeout", type=float, default=30.0,
                        help="seconds a remote prefill (first token and KV) may take before the worker prefills locally")
    parser.add_argument("--drain-timeout", type=_non_negative, default=5.0,
                        help="on SIGTERM, seconds the worker's running requests may go on before it hands them back "
                             "to their gateways, which move them to other workers (default: 5)")
    parser.add_argument("--gather-ms", type=_non_negative, default=None,
                        help="an idle worker's first step waits this long at most for the rest of a burst of "
                             "requests (0: never; default: services.common.engine_loop.DEFAULT_GATHER_S)")
    return parser


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


async def serve(args: argparse.Namespace) -> int:
    from services.common.cpu_loan import cpu_share_from_args
    from services.common.engine_loop import DEFAULT_GATHER_S
    from services.common.engine_thread import EngineThread
    from services.common.runner import run_service
    from services.common.engine_worker import EngineWorker
    from services.decode.worker import DecodeRole
    from shared.engine.engine import LLMEngine

    model_dir, served_name = resolve_model(args)

    tls = transfer_tls_of(args)

    async def build(nc, js, registry, subjects, replicas):
        cpu_share = cpu_share_from_args(args)
        engine_thread = EngineThread()
        engine = await engine_thread.run(LLMEngine, engine_config(args, model_dir))
        receiver = None
        if args.mode == "disagg":
            from services.common.queues import provision_prefill_queue
            from shared.transfer import KVReceiver

            await provision_prefill_queue(js, subjects, replicas)
            receiver = KVReceiver(tls=tls)
            host, advertise = side_channel_address(args, args.kv_receiver_host, args.kv_receiver_advertise)
            await receiver.start(host, args.kv_receiver_port, advertise_host=advertise)
        worker = EngineWorker(nc=nc, registry=registry, subjects=subjects, engine=engine, engine_thread=engine_thread,
                              instance_id=args.instance_id, role="decode", model=model_dir,
                              served_model_name=served_name, cpu_share=cpu_share,
                              gather_s=DEFAULT_GATHER_S if args.gather_ms is None else args.gather_ms / 1000)
        worker.role = DecodeRole(worker, mode=args.mode, max_active_requests=args.max_active_requests,
                                 receiver=receiver, prefill_timeout_s=args.prefill_timeout,
                                 drain_timeout_s=args.drain_timeout)
        if args.kv_store:
            from services.common.kvstore_tier import start_kv_store_tier

            worker.kv_store = await start_kv_store_tier(args, nc=nc, subjects=subjects, registry=registry,
                                                         engine=engine, engine_loop=worker.engine_loop)
        return worker

    return await run_service(args, "decode", build)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_engine_placement(args)
    return run_async(serve(args))


if __name__ == "__main__":
    sys.exit(main())
