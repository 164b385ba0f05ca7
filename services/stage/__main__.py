"""`python -m services.stage`: one pipeline stage; with `--layers 0:N` the pipeline's head."""

import argparse
import sys
from typing import TYPE_CHECKING

from services.common.options import (
    add_bus_options,
    add_side_channel_options,
    side_channel_address,
    transfer_tls_of,
    apply_engine_placement,
    add_engine_options,
    add_model_options,
    engine_config,
    env_default,
    resolve_model,
    run_async,
)

if TYPE_CHECKING:
    from services.common.engine_thread import EngineThread


def layer_range(text: str):
    from shared.engine.model_loader import LayerRange

    try:
        start, end = (int(v) for v in text.split(":"))
        return LayerRange(start, end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a layer range START:END, e.g. 0:6") from None


def stage_list(text: str) -> list[str]:
    stages = [s.strip() for s in text.split(",") if s.strip()]
    if not stages:
        raise argparse.ArgumentTypeError("name at least one stage")
    return stages


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve stage",
                                     description="A pipeline stage: a contiguous range of the model's layers.")
    add_bus_options(parser, "stage")
    add_side_channel_options(parser)
    add_model_options(parser)
    add_engine_options(parser)
    parser.add_argument("--layers", type=layer_range, required=True,
                        help="this stage's layers START:END; a stage from 0 is the head (it takes the requests)")
    parser.add_argument("--stages", type=stage_list,
                        help="head only: the instance ids of the stages after it, in layer order")
    parser.add_argument("--microbatches", type=int, default=2, help="head only: steps in flight at once")
    parser.add_argument("--step-timeout", type=float, default=60.0,
                        help="head only: seconds a step may take through the pipeline before its requests fail")
    parser.add_argument("--stage-wait", type=float, default=300.0,
                        help="head only: seconds to wait at start for the stages to be ready")
    parser.add_argument("--head-role", default="decode", choices=["decode", "prefill"],
                        help="head only: what the pipeline serves: requests (decode: the pipeline topology) or "
                             "prefill jobs (a pipelined prefill pool in the disagg topology)")
    parser.add_argument("--max-active-requests", type=int, default=512, help="decode head: requests taken at most")
    parser.add_argument("--max-concurrent-jobs", type=int, default=8, help="prefill head: prefill jobs taken at once")
    parser.add_argument("--ships-kv", action="store_true",
                        help="stages of a prefill pipeline: keep the KV cache where the side channel reads it in "
                             "place (shared memory), as each stage ships its own layers' KV to decode workers")
    parser.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "tcp"],
                        help="prefill pipelines: how the head and the stages ship KV to decode workers")
    parser.add_argument("--num-kv-blocks", type=int,
                        help="stages after the head: KV blocks (default: what --kv-cache-bytes holds); "
                             "the head takes the smallest of its stages' counts and its own")
    parser.add_argument("--inline-activation-bytes", type=int, default=256 << 10,
                        help="activations up to this size ride NATS; bigger ones go over the side channel")
    parser.add_argument("--activation-transport", default="auto", choices=["auto", "shm", "tcp"],
                        help="the side channel's backend for big activations")
    parser.add_argument("--transfer-host", default=env_default("TRANSFER_HOST", None),
                        help="address this stage's side channel listens on (default: --advertise-host's)")
    parser.add_argument("--transfer-advertise", default=env_default("TRANSFER_ADVERTISE", None),
                        help="the address other stages dial (needed when listening on 0.0.0.0)")
    return parser


def head_bytes_per_block(model_dir: str, args: argparse.Namespace) -> int:
    from shared.engine.kv_cache import PagedKVCache
    from shared.engine.model_loader import read_config, resolve_dtype

    config = read_config(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return PagedKVCache.bytes_per_block(args.layers.end, args.block_size, getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                                        resolve_dtype(args.dtype, config))


async def build_head(args: argparse.Namespace, registry, link, model_dir: str, num_layers: int,
                     engine_thread: "EngineThread"):
    """The head's engine and its pipeline driver, once its stages are up and fit together."""
    import dataclasses

    from services.common.kv_memory import kv_cache_allocator
    from services.stage.driver import PipelineDriver, wait_for_stages
    from shared.engine.model_loader import LayerRange
    from shared.engine.pipeline import LayerSplitError, PipelineHeadEngine, check_layer_split

    stages = await wait_for_stages(registry, args.stages, args.stage_wait)
    ranges = [args.layers] + [LayerRange(*stages[iid].layer_range) for iid in args.stages]
    try:
        check_layer_split(ranges, num_layers)
    except LayerSplitError as exc:
        raise SystemExit(f"the pipeline's stages do not fit together: {exc}") from None
    for iid in args.stages:
        if stages[iid].kv_block_size != args.block_size:
            raise SystemExit(f"stage {iid} has KV blocks of {stages[iid].kv_block_size} tokens; "
                             f"the head has {args.block_size}")
    # Steps name the head's block ids, so the head uses no more blocks than any stage has.
    own_blocks = args.kv_cache_bytes // head_bytes_per_block(model_dir, args)
    num_blocks = max(1, min([own_blocks] + [stages[iid].kv_blocks_total for iid in args.stages]))
    config = dataclasses.replace(engine_config(args, model_dir), layer_ranges=[args.layers], num_kv_blocks=num_blocks)
    driver = PipelineDriver(instance_id=args.instance_id, registry=registry, link=link, stages=list(args.stages),
                            stage_boot_ids={iid: stages[iid].boot_id for iid in args.stages})
    allocator = kv_cache_allocator(args.kv_transport, args.device) if args.head_role == "prefill" else None
    engine = await engine_thread.run(PipelineHeadEngine, config, driver.submit, num_microbatches=args.microbatches,
                                     step_timeout_s=args.step_timeout, kv_allocator=allocator)
    return engine, driver


async def serve(args: argparse.Namespace) -> int:

    from services.common.engine_thread import EngineThread
    from services.common.runner import run_service
    from services.stage.link import ActivationLink
    from shared.engine.model_loader import read_config
    from shared.transfer import KVReceiver, KVSender

    model_dir, served_name = resolve_model(args)
    num_layers = read_config(model_dir).num_hidden_layers
    if args.layers.end > num_layers:
        raise SystemExit(f"--layers {args.layers.start}:{args.layers.end} is beyond the model's {num_layers} layers")
    is_head = args.layers.start == 0
    if is_head and not args.stages:
        raise SystemExit("the head (--layers 0:N) needs --stages: the stages after it, in order")
    if args.microbatches < 1:
        raise SystemExit("--microbatches must be at least 1")
    tls = transfer_tls_of(args)

    async def build(nc, js, registry, subjects, replicas):
        engine_thread = EngineThread()
        # An activation travels as one part: a prefill chunk of 8k tokens of a 8192-wide float32 model is 256 MiB.
        receiver = KVReceiver(max_part_bytes=1 << 30, max_buffer_bytes=2 << 30, tls=tls)
        host, advertise = side_channel_address(args, args.transfer_host, args.transfer_advertise)
        await receiver.start(host, 0, advertise_host=advertise)
        link = ActivationLink(nc=nc, subjects=subjects, instance_id=args.instance_id, receiver=receiver,
                              sender=KVSender(tls=tls), inline_bytes=args.inline_activation_bytes,
                              transport=args.activation_transport, hop_timeout_s=args.step_timeout)
        if not is_head:
            from services.common.kv_memory import kv_cache_allocator
            from services.stage.worker import StageWorker
            from shared.engine.stage import StageRunner

            runner = await engine_thread.run(
                StageRunner, model_dir, args.layers, dtype=args.dtype, device=args.device,
                block_size=args.block_size, num_blocks=args.num_kv_blocks, kv_cache_bytes=args.kv_cache_bytes,
                kv_allocator=kv_cache_allocator(args.kv_transport, args.device) if args.ships_kv else None)
            return StageWorker(nc=nc, registry=registry, subjects=subjects, instance_id=args.instance_id,
                               runner=runner, engine_thread=engine_thread, link=link, model=model_dir, served_model_name=served_name,
                               kv_transport=args.kv_transport)

        from services.common.engine_worker import EngineWorker

        engine, driver = await build_head(args, registry, link, model_dir, num_layers, engine_thread)
        worker = EngineWorker(nc=nc, registry=registry, subjects=subjects, engine=engine, engine_thread=engine_thread,
                              instance_id=args.instance_id, role=args.head_role, model=model_dir,
                              served_model_name=served_name)
        if args.head_role == "prefill":
            from services.common.queues import provision_prefill_queue
            from services.stage.prefill_head import prefill_pipeline_head

            await provision_prefill_queue(js, subjects, replicas)
            return prefill_pipeline_head(worker, driver, max_concurrent_jobs=args.max_concurrent_jobs,
                                         kv_transport=args.kv_transport, transfer_tls=tls)
        from services.stage.head import decode_pipeline_head

        return decode_pipeline_head(worker, driver, max_active_requests=args.max_active_requests)

    # Every stage process logs and traces as a stage (splitserve-stage); a head registers as its head role.
    return await run_service(args, "stage", build)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_engine_placement(args)
    return run_async(serve(args))


if __name__ == "__main__":
    sys.exit(main())
