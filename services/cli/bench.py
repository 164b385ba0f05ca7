"""`splitserve bench` (a load generator for any OpenAI-compatible server) and `splitserve bench compare`
(one workload against several topologies started in turn). The code lives in services/bench/."""

import argparse
import importlib.util
import sys

# What `pip install 'splitserve[bench]'` adds, and which runs need it.
BENCH_EXTRA = {"httpx": lambda args: True, "matplotlib": lambda args: bool(getattr(args, "plot", None))}


def missing_extra(args: argparse.Namespace) -> list[str]:
    """The bench extra's packages this run needs and this environment lacks."""
    return [name for name, needed in BENCH_EXTRA.items() if needed(args) and importlib.util.find_spec(name) is None]


def _with_extra(run):
    def checked(args: argparse.Namespace) -> int:
        missing = missing_extra(args)
        if missing:
            print(f"error: splitserve bench needs {', '.join(missing)}: pip install 'splitserve[bench]'",
                  file=sys.stderr)
            return 2
        return run(args)
    return checked


def add_parser(subcommands) -> None:
    from services.bench import compare as bench_compare, serve as bench_serve

    parser = subcommands.add_parser(
        "bench", help="measure a server: TTFT, TPOT, ITL, E2E latency, throughput, goodput",
        description=bench_serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_serve.add_parser_options(parser)
    parser.set_defaults(run=_with_extra(bench_serve.main))
    modes = parser.add_subparsers(dest="bench_mode")
    compare = modes.add_parser(
        "compare", help="run one workload against several topologies in turn and show them side by side",
        description=bench_compare.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_compare.add_parser_options(compare)
    compare.set_defaults(run=_with_extra(bench_compare.main))
