"""`python -m services.stage`: one pipeline stage; with `--layers 0:N` the pipeline's head."""

import argparse
import sys
from typing import TYPE_CHECKING

from services.common.options import (
    apply_engine_placement,
    engine_config,
    resolve_model,
    run_async,
    side_channel_address,
    transfer_tls_of,
)
from services.common.settings import add_flags, parse_settings
from services.stage.settings import StageSettings

if TYPE_CHECKING:
    from services.common.engine_thread import EngineThread


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve stage",
                                     description="A pipeline stage: a contiguous range of the model's layers.")
    add_flags(parser, StageSettings)
    return parser


def settings_of(argv: list[str] | None = None, environ=None) -> StageSettings:
    return parse_settings(build_parser(), StageSettings, argv, environ)


def head_bytes_per_block(model_dir: str, settings: StageSettings) -> int:
    from shared.engine import PagedKVCache, read_config, resolve_dtype

    config = read_config(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return PagedKVCache.bytes_per_block(settings.layers.end, settings.block_size, getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                                        resolve_dtype(settings.dtype, config))


async def build_head(settings: StageSettings, registry, link, model_dir: str, num_layers: int,
                     engine_thread: "EngineThread"):
    """The head's engine and its pipeline driver, once its stages are up and fit together."""
    import dataclasses

    from services.common.kv_memory import kv_cache_allocator
    from services.stage.driver import PipelineDriver, wait_for_stages
    from shared.engine import LayerRange, LayerSplitError, PipelineHeadEngine, check_layer_split

    stages = await wait_for_stages(registry, settings.stages, settings.stage_wait)
    ranges = [settings.layers] + [LayerRange(*stages[iid].layer_range) for iid in settings.stages]
    try:
        check_layer_split(ranges, num_layers)
    except LayerSplitError as exc:
        raise SystemExit(f"the pipeline's stages do not fit together: {exc}") from None
    for iid in settings.stages:
        if stages[iid].kv_block_size != settings.block_size:
            raise SystemExit(f"stage {iid} has KV blocks of {stages[iid].kv_block_size} tokens; "
                             f"the head has {settings.block_size}")
    # Steps name the head's block ids, so the head uses no more blocks than any stage has.
    own_blocks = settings.kv_cache_bytes // head_bytes_per_block(model_dir, settings)
    num_blocks = max(1, min([own_blocks] + [stages[iid].kv_blocks_total for iid in settings.stages]))
    config = dataclasses.replace(engine_config(settings, model_dir), layer_ranges=[settings.layers], num_kv_blocks=num_blocks)
    driver = PipelineDriver(instance_id=settings.instance_id, registry=registry, link=link, stages=list(settings.stages),
                            stage_boot_ids={iid: stages[iid].boot_id for iid in settings.stages})
    allocator = kv_cache_allocator(settings.kv_transport, settings.device) if settings.head_role == "prefill" else None
    engine = await engine_thread.run(PipelineHeadEngine, config, driver.submit, num_microbatches=settings.microbatches,
                                     step_timeout_s=settings.step_timeout, kv_allocator=allocator)
    return engine, driver


async def serve(settings: StageSettings) -> int:
    from services.common.cpu_follow import engine_cpu_share
    from services.common.engine_thread import EngineThread
    from services.common.runner import run_service
    from services.stage.link import ActivationLink
    from shared.engine import read_config
    from shared.transfer import KVReceiver, KVSender

    if settings.cpus_file and settings.layers.start != 0:
        raise SystemExit("--cpus-file: a stage after the head runs no engine loop to follow it between steps (only a "
                         "head and whole-model workers do)")
    model_dir, served_name = resolve_model(settings)
    num_layers = read_config(model_dir).num_hidden_layers
    if settings.layers.end > num_layers:
        raise SystemExit(f"--layers {settings.layers.start}:{settings.layers.end} is beyond the model's {num_layers} layers")
    if settings.gpu_memory_utilization is not None:
        raise SystemExit("a pipeline stage's KV cache is --kv-cache-bytes (a head's, its stages' smallest): "
                         "--gpu-memory-utilization sizes whole-model workers'")
    is_head = settings.layers.start == 0
    if is_head and not settings.stages:
        raise SystemExit("the head (--layers 0:N) needs --stages: the stages after it, in order")
    if settings.microbatches < 1:
        raise SystemExit("--microbatches must be at least 1")
    tls = transfer_tls_of(settings)

    async def build(nc, js, registry, subjects, replicas):
        engine_thread = EngineThread()
        # An activation travels as one part: a prefill chunk of 8k tokens of a 8192-wide float32 model is 256 MiB.
        receiver = KVReceiver(max_part_bytes=1 << 30, max_buffer_bytes=2 << 30, tls=tls)
        host, advertise = side_channel_address(settings, settings.transfer_host, settings.transfer_advertise)
        await receiver.start(host, 0, advertise_host=advertise)
        link = ActivationLink(nc=nc, subjects=subjects, instance_id=settings.instance_id, receiver=receiver,
                              sender=KVSender(tls=tls), inline_bytes=settings.inline_activation_bytes,
                              transport=settings.activation_transport, hop_timeout_s=settings.step_timeout)
        if not is_head:
            from services.common.kv_memory import kv_cache_allocator
            from services.stage.worker import StageWorker
            from shared.engine import StageRunner

            runner = await engine_thread.run(
                StageRunner, model_dir, settings.layers, dtype=settings.dtype, device=settings.device,
                block_size=settings.block_size, num_blocks=settings.num_kv_blocks, kv_cache_bytes=settings.kv_cache_bytes,
                kv_allocator=kv_cache_allocator(settings.kv_transport, settings.device) if settings.ships_kv else None)
            return StageWorker(nc=nc, registry=registry, subjects=subjects, instance_id=settings.instance_id,
                               runner=runner, engine_thread=engine_thread, link=link, model=model_dir, served_model_name=served_name,
                               kv_transport=settings.kv_transport)

        from services.common.engine_worker import EngineWorker

        engine, driver = await build_head(settings, registry, link, model_dir, num_layers, engine_thread)
        worker = EngineWorker(nc=nc, registry=registry, subjects=subjects, engine=engine, engine_thread=engine_thread,
                              instance_id=settings.instance_id, role=settings.head_role, model=model_dir,
                              served_model_name=served_name, cpu_share=engine_cpu_share(settings))
        if settings.head_role == "prefill":
            from services.stage.prefill_head import prefill_pipeline_head

            return prefill_pipeline_head(worker, driver, max_concurrent_jobs=settings.max_concurrent_jobs,
                                         kv_transport=settings.kv_transport, transfer_tls=tls)
        from services.stage.head import decode_pipeline_head

        return decode_pipeline_head(worker, driver, max_active_requests=settings.max_active_requests,
                                    drain_timeout_s=settings.drain_timeout)

    # Every stage process logs and traces as a stage (splitserve-stage); a head registers as its head role.
    return await run_service(settings, "stage", build)


def main(argv: list[str] | None = None) -> int:
    settings = settings_of(argv)
    apply_engine_placement(settings)
    return run_async(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
