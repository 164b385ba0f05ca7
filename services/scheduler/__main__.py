"""`python -m services.scheduler`: routes requests from the JetStream queue to workers."""

import argparse
import sys

from services.common.options import add_bus_options, factor_or_off, run_async
from services.scheduler.routing import DEFAULT_PREFILL_BACKLOG_FACTOR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve scheduler", description="The request scheduler.")
    add_bus_options(parser, "scheduler")
    parser.add_argument("--handoff-timeout", type=float, default=5.0, help="seconds a worker has to take a request")
    parser.add_argument("--max-local-prefill", type=int, default=256,
                        help="prompts with more uncached tokens than this are prefilled remotely (0: always remote)")
    parser.add_argument("--max-prefill-queue", type=int, default=64,
                        help="prefill locally when this many prefill jobs are already queued")
    parser.add_argument("--prefill-backlog-factor", type=factor_or_off, default=DEFAULT_PREFILL_BACKLOG_FACTOR,
                        help="prefill a prompt over --max-local-prefill locally when each prefill worker has more than "
                             "this many times its uncached tokens queued ahead of it (e.g. 0.5; default: %(default)s, "
                             "never; --max-local-prefill 0 keeps every prompt remote)")
    parser.add_argument("--offload-short-prefills", action=argparse.BooleanOptionalAction, default=True,
                        help="send a prompt within --max-local-prefill to an idle prefill worker too, when its "
                             "decode worker is busy streaming (computing it there stalls every stream for a step)")
    parser.add_argument("--router", default="kv", choices=["load", "kv"],
                        help="kv: score workers by the prompt prefix their caches hold (from KV events) and their "
                             "load; load: least loaded first")
    parser.add_argument("--kv-overlap-weight", type=float, default=2.0,
                        help="kv router: weight of a prompt block to compute against a KV block in use")
    parser.add_argument("--prefix-index-blocks", type=int, default=1 << 18,
                        help="kv router: block hashes the prefix index keeps at most (least recently used go first; "
                             "about 360 bytes each)")
    return parser


async def serve(args: argparse.Namespace) -> int:
    from services.common.queues import provision_request_queue
    from services.common.runner import run_service
    from services.scheduler.router import Router

    async def build(nc, js, registry, subjects, replicas):
        await provision_request_queue(js, subjects, replicas)
        return Router(nc=nc, registry=registry, subjects=subjects, instance_id=args.instance_id,
                      handoff_timeout_s=args.handoff_timeout, max_local_prefill=args.max_local_prefill,
                      max_prefill_queue=args.max_prefill_queue, offload_short_prefills=args.offload_short_prefills,
                      prefill_backlog_factor=args.prefill_backlog_factor,
                      router=args.router,
                      overlap_weight=args.kv_overlap_weight, max_index_blocks=args.prefix_index_blocks)

    return await run_service(args, "scheduler", build)


def main(argv: list[str] | None = None) -> int:
    return run_async(serve(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
