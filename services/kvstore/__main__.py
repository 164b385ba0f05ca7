"""`python -m services.kvstore`: one kv-store instance."""

import argparse
import sys

from services.common.options import (
    run_async,
    side_channel_address,
    transfer_tls_of,
)
from services.common.settings import add_flags, parse_settings
from services.kvstore.settings import KVStoreSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve kvstore",
                                     description="A kv-store: prefix KV blocks in RAM, spilling to disk.")
    add_flags(parser, KVStoreSettings)
    return parser


def settings_of(argv: list[str] | None = None, environ=None) -> KVStoreSettings:
    return parse_settings(build_parser(), KVStoreSettings, argv, environ)


async def serve(settings: KVStoreSettings) -> int:
    import torch

    from services.common.runner import run_service
    from services.kvstore.service import KVStoreService
    from services.kvstore.store import TieredBlockStore
    from shared.transfer import KVReceiver, KVSender

    if settings.kv_store_disk_bytes and not settings.kv_store_dir:
        raise SystemExit("--kv-store-disk-bytes needs --kv-store-dir")
    if settings.kv_store_ram_bytes < 0 or settings.kv_store_disk_bytes < 0:
        raise SystemExit("tier sizes cannot be negative")
    tls = transfer_tls_of(settings)
    # Its torch work (checksums and copies of single blocks) is too small to split, and beside busy model workers
    # a second OpenMP thread waits for a core at every op: one 737 KB block's checksum took 7.8 ms instead of 0.03.
    torch.set_num_threads(1)

    async def build(nc, js, registry, subjects, replicas):
        store = TieredBlockStore(settings.kv_store_ram_bytes, settings.kv_store_disk_bytes, settings.kv_store_dir)
        receiver = KVReceiver(tls=tls)
        host, advertise = side_channel_address(settings, settings.transfer_host, settings.transfer_advertise)
        await receiver.start(host, 0, advertise_host=advertise)
        return KVStoreService(nc=nc, registry=registry, subjects=subjects, instance_id=settings.instance_id, store=store,
                              receiver=receiver, sender=KVSender(tls=tls),
                              max_put_bytes=settings.kv_store_max_put_bytes,
                              max_put_bytes_in_flight=settings.kv_store_max_put_bytes_in_flight)

    return await run_service(settings, "kvstore", build)


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(settings_of(argv)))


if __name__ == "__main__":
    sys.exit(main())
