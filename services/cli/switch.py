"""`splitserve switch ID ROLE`: switch a running worker between the prefill and decode pools, keeping its loaded
model (a deployment started with `up --role-switch`).

It calls the launcher's control API (`POST /v1/switch {"instance": ID, "to": ROLE}`), which sends the switch to the
worker under the deployment's admin key and answers once the worker serves in its new role; with --wait it then
reads `GET /v1/deployment` until every pool is ready at its new size.
"""

import argparse
import sys

from services.cli.scale import add_wait_options, control_socket, post
from services.cli.up import add_run_dir_option

CALL_TIMEOUT_S = 700.0  # the longest drain a switch may be given, and then some


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "switch", help="switch a worker between the prefill and decode pools without reloading its model",
        description="Drain the worker in its current role (its streams finish or move to another worker; a prefill "
        "worker finishes its jobs), then serve in ROLE on the same loaded engine. Needs `splitserve up "
        "--role-switch`; each pool keeps at least one worker. `splitserve ps` shows each worker's role now.")
    parser.add_argument("instance", metavar="ID", help="the worker, as `splitserve ps` names it (e.g. decode-1)")
    parser.add_argument("role", choices=("prefill", "decode"), help="its new role")
    add_run_dir_option(parser)
    parser.add_argument("--drain", type=float, default=None, metavar="S", help="seconds its running work may go on "
                        "before it is handed back (default: the worker's drain timeout)")
    add_wait_options(parser, run)


def _fail(message: str, code: int = 1) -> int:
    print(f"splitserve switch: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from services.launcher.deployment import resolve_run_dir

    try:
        path = control_socket(resolve_run_dir(args.run_dir))
    except ValueError as exc:
        return _fail(str(exc))
    body = {"instance": args.instance, "to": args.role, **({"drain_s": args.drain} if args.drain is not None else {})}
    return post(path, "/v1/switch", body, args, _fail, lambda answer: (
        f"switched {answer['instance']} to {answer['role']} (role epoch {answer['role_epoch']}): drained in "
        f"{answer['drain_s']:.3f} s, serving {answer['switch_s']:.3f} s later"), timeout_s=CALL_TIMEOUT_S)
