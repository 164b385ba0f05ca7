"""`python -m services.decode`: one decode worker."""

import argparse
import sys

from services.common.options import (
    apply_engine_placement,
    engine_config,
    resolve_model,
    run_async,
    side_channel_address,
    transfer_tls_of,
)
from services.common.settings import add_flags, parse_settings
from services.decode.settings import DecodeSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve decode", description="A decode worker.")
    add_flags(parser, DecodeSettings)
    return parser


def settings_of(argv: list[str] | None = None, environ=None) -> DecodeSettings:
    return parse_settings(build_parser(), DecodeSettings, argv, environ)


async def serve(settings: DecodeSettings) -> int:
    from services.common.cpu_follow import engine_cpu_share
    from services.common.engine_thread import EngineThread
    from services.common.runner import run_service
    from services.common.engine_worker import EngineWorker
    from services.common.role_switch import switchable
    from services.decode.role_builder import decode_role_builder
    from services.prefill.role_builder import prefill_role_builder
    from services.decode.worker import DecodeRole
    from shared.engine import LLMEngine

    model_dir, served_name = resolve_model(settings)

    tls = transfer_tls_of(settings)

    async def build(nc, js, registry, subjects, replicas):
        cpu_share = engine_cpu_share(settings)
        engine_thread = EngineThread()
        engine = await engine_thread.run(LLMEngine, engine_config(settings, model_dir))
        receiver = None
        if settings.mode == "disagg":
            from shared.transfer import KVReceiver

            receiver = KVReceiver(tls=tls)
            host, advertise = side_channel_address(settings, settings.kv_receiver_host, settings.kv_receiver_advertise)
            await receiver.start(host, settings.kv_receiver_port, advertise_host=advertise)
        worker = EngineWorker(nc=nc, registry=registry, subjects=subjects, engine=engine, engine_thread=engine_thread,
                              instance_id=settings.instance_id, role="decode", model=model_dir,
                              served_model_name=served_name, cpu_share=cpu_share,
                              gather_s=settings.gather_ms / 1000)
        worker.role = DecodeRole(worker, mode=settings.mode, max_active_requests=settings.max_active_requests,
                                 receiver=receiver, prefill_timeout_s=settings.prefill_timeout,
                                 drain_timeout_s=settings.drain_timeout)
        switchable(worker, settings, {"decode": decode_role_builder(settings, tls),
                                      "prefill": prefill_role_builder(settings, tls)})
        if settings.kv_store:
            from contracts import Sender
            from services.kvstore.tier import start_kv_store_tier

            worker.kv_store = await start_kv_store_tier(settings, nc=nc, subjects=subjects, registry=registry,
                                                         engine=engine, engine_loop=worker.engine_loop,
                                                         me=Sender(worker.identity.role, worker.instance_id))
        return worker

    return await run_service(settings, "decode", build)


def main(argv: list[str] | None = None) -> int:
    settings = settings_of(argv)
    apply_engine_placement(settings)
    return run_async(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
