"""`splitserve bench` (a load generator for any OpenAI-compatible server) and `splitserve bench compare`
(one workload against several topologies started in turn). The code lives in loadtest/."""

import argparse


def add_parser(subcommands) -> None:
    from loadtest import bench_compare, bench_serve

    parser = subcommands.add_parser(
        "bench", help="measure a server: TTFT, TPOT, ITL, E2E latency, throughput, goodput",
        description=bench_serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_serve.add_parser_options(parser)
    parser.set_defaults(run=bench_serve.main)
    modes = parser.add_subparsers(dest="bench_mode")
    compare = modes.add_parser(
        "compare", help="run one workload against several topologies in turn and show them side by side",
        description=bench_compare.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_compare.add_parser_options(compare)
    compare.set_defaults(run=bench_compare.main)
