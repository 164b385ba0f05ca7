"""`python -m services.prefill`: one prefill worker."""

import argparse
import sys

from services.common.options import (
    apply_engine_placement,
    engine_config,
    resolve_model,
    run_async,
    transfer_tls_of,
)
from services.common.settings import add_flags, parse_settings
from services.prefill.settings import PrefillSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve prefill", description="A prefill worker.")
    add_flags(parser, PrefillSettings)
    return parser


def settings_of(argv: list[str] | None = None, environ=None) -> PrefillSettings:
    return parse_settings(build_parser(), PrefillSettings, argv, environ)


async def serve(settings: PrefillSettings) -> int:
    from services.common.cpu_follow import engine_cpu_share
    from services.common.engine_thread import EngineThread
    from services.common.runner import run_service
    from services.common.kv_memory import kv_cache_allocator
    from services.common.engine_worker import EngineWorker
    from services.common.role_switch import switchable
    from services.decode.role_builder import decode_role_builder
    from services.prefill.role_builder import prefill_role_builder
    from services.prefill.worker import PrefillRole
    from shared.engine import LLMEngine

    model_dir, served_name = resolve_model(settings)
    tls = transfer_tls_of(settings)

    async def build(nc, js, registry, subjects, replicas):
        cpu_share = engine_cpu_share(settings)  # before loading: its CPUs are not lent while it loads
        engine_thread = EngineThread()
        engine = await engine_thread.run(LLMEngine, engine_config(settings, model_dir),
                                         kv_allocator=kv_cache_allocator(settings.kv_transport, settings.device))
        worker = EngineWorker(nc=nc, registry=registry, subjects=subjects, engine=engine, engine_thread=engine_thread,
                              instance_id=settings.instance_id, role="prefill", model=model_dir,
                              served_model_name=served_name, cpu_share=cpu_share)
        worker.role = PrefillRole(worker, max_concurrent_jobs=settings.max_concurrent_jobs, kv_transport=settings.kv_transport,
                                  transfer_tls=tls)
        switchable(worker, settings, {"decode": decode_role_builder(settings, tls),
                                      "prefill": prefill_role_builder(settings, tls)})
        if settings.kv_store:
            from contracts import Sender
            from services.kvstore.tier import start_kv_store_tier

            worker.kv_store = await start_kv_store_tier(settings, nc=nc, subjects=subjects, registry=registry,
                                                         engine=engine, engine_loop=worker.engine_loop,
                                                         me=Sender(worker.identity.role, worker.instance_id))
        return worker

    return await run_service(settings, "prefill", build)


def main(argv: list[str] | None = None) -> int:
    settings = settings_of(argv)
    apply_engine_placement(settings)
    return run_async(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
