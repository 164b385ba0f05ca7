"""`python -m services.decode`: one decode worker."""

import argparse
import asyncio
import sys

from services.common.options import add_bus_options, add_model_options, env_default, resolve_model, run_async


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve decode", description="A decode worker.")
    add_bus_options(parser, "decode")
    add_model_options(parser)
    parser.add_argument("--mode", default="colocated", choices=["colocated"], help="colocated: also prefills its requests")
    parser.add_argument("--device", default=env_default("DEVICE", "cpu"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-bytes", type=int, default=int(env_default("KV_CACHE_BYTES", 512 << 20)))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-active-requests", type=int, default=512, help="running plus queued requests taken at most")
    return parser


async def serve(args: argparse.Namespace) -> int:
    from contracts import Subjects
    from services.decode.worker import DecodeWorker
    from shared.bus.connection import ShutdownSignal, connect, drain
    from shared.bus.registry import Registry
    from shared.bus.service import run_until_stopped
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.telemetry.logging import configure_logging, get_logger

    configure_logging("decode", args.instance_id, args.log_level)
    log = get_logger("decode")
    shutdown = ShutdownSignal()
    subjects = Subjects(args.namespace)
    model_dir, served_name = resolve_model(args)
    config = EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    engine = await asyncio.to_thread(LLMEngine, config)
    log.info("engine loaded", model=model_dir, kv_blocks=engine.block_manager.num_blocks)
    nc = await connect(args.nats, name=args.instance_id)
    registry = await Registry.open(nc.jetstream(), subjects.registry_bucket)
    worker = DecodeWorker(
        nc=nc,
        registry=registry,
        engine=engine,
        subjects=subjects,
        instance_id=args.instance_id,
        model=model_dir,
        served_model_name=served_name,
        mode=args.mode,
        max_active_requests=args.max_active_requests,
    )
    tasks = await worker.start()
    log.info("decode worker ready", instance_id=args.instance_id)
    code = await run_until_stopped(*tasks, shutdown=shutdown)
    await worker.stop()
    await drain(nc)
    return code


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
