"""`python -m services.kvstore`: one kv-store instance."""

import argparse
import sys

from services.common.options import (
    add_bus_options,
    add_side_channel_options,
    env_default,
    run_async,
    side_channel_address,
    transfer_tls_of,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve kvstore",
                                     description="A kv-store: prefix KV blocks in RAM, spilling to disk.")
    add_bus_options(parser, "kvstore")
    add_side_channel_options(parser)
    parser.add_argument("--kv-store-ram-bytes", type=int, default=int(env_default("KV_STORE_RAM_BYTES", 1 << 30)),
                        help="RAM tier size; least recently used blocks beyond it spill to disk")
    parser.add_argument("--kv-store-disk-bytes", type=int, default=int(env_default("KV_STORE_DISK_BYTES", 0)),
                        help="disk tier size (0: no disk tier); least recently used blocks beyond it are dropped")
    parser.add_argument("--kv-store-dir", default=env_default("KV_STORE_DIR", None),
                        help="the disk tier's directory (needed with --kv-store-disk-bytes); a restart finds it again")
    parser.add_argument("--transfer-host", default=env_default("TRANSFER_HOST", None),
                        help="address the side channel listens on; keep it on the deployment's network only "
                             "(default: --advertise-host's)")
    parser.add_argument("--transfer-advertise", default=env_default("TRANSFER_ADVERTISE", None),
                        help="the address workers dial (needed when listening on 0.0.0.0)")
    return parser


async def serve(args: argparse.Namespace) -> int:
    import torch

    from services.common.runner import run_service
    from services.kvstore.service import KVStoreService
    from services.kvstore.store import TieredBlockStore
    from shared.transfer import KVReceiver, KVSender

    if args.kv_store_disk_bytes and not args.kv_store_dir:
        raise SystemExit("--kv-store-disk-bytes needs --kv-store-dir")
    if args.kv_store_ram_bytes < 0 or args.kv_store_disk_bytes < 0:
        raise SystemExit("tier sizes cannot be negative")
    tls = transfer_tls_of(args)
    # Its torch work (checksums and copies of single blocks) is too small to split, and beside busy model workers
    # a second OpenMP thread waits for a core at every op: one 737 KB block's checksum took 7.8 ms instead of 0.03.
    torch.set_num_threads(1)

    async def build(nc, js, registry, subjects, replicas):
        store = TieredBlockStore(args.kv_store_ram_bytes, args.kv_store_disk_bytes, args.kv_store_dir)
        receiver = KVReceiver(tls=tls)
        host, advertise = side_channel_address(args, args.transfer_host, args.transfer_advertise)
        await receiver.start(host, 0, advertise_host=advertise)
        return KVStoreService(nc=nc, registry=registry, subjects=subjects, instance_id=args.instance_id, store=store,
                              receiver=receiver, sender=KVSender(tls=tls))

    return await run_service(args, "kvstore", build)


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
