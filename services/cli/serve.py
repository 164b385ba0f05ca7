"""`splitserve serve NAME [ARGS...]`: one service in the foreground.

Exactly `python -m services.NAME ARGS...` (the same module, run as
`__main__`), which is what each container of compose/docker-compose.yml runs.
`splitserve serve NAME --help` shows the service's own flags.
"""

import argparse
import importlib.util
import runpy
import sys

SERVICE_NAMES = ("gateway", "scheduler", "decode", "prefill", "stage", "kvstore", "planner")


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "serve",
        help="run one service in the foreground (what each container runs)",
        description="Run one service on its own, connecting to a given NATS server: the same as "
        "`python -m services.NAME ARGS...`. `splitserve serve NAME --help` lists the service's flags.",
    )
    parser.add_argument("name", metavar="NAME", choices=SERVICE_NAMES, help=f"one of: {', '.join(SERVICE_NAMES)}")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the service's own flags")
    parser.set_defaults(run=run)


def run_module(module: str, args: list[str]) -> int:
    """Run `module` as `python -m module args...` would, in this process."""
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(module)
    sys.argv = [module, *args]  # runpy puts the module's file in argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0  # a module that returns without sys.exit() succeeded


def run(args: argparse.Namespace) -> int:
    module = f"services.{args.name}"
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        print(f"splitserve serve: error: the {args.name} service is not installed ({module} not found)", file=sys.stderr)
        return 2
    return run_module(module, list(args.args))
