"""`splitserve scale ROLE=N ...`: resize a running deployment's decode and prefill pools.

It calls the launcher's control API on its Unix socket (RUN_DIR/control.sock, named in deployment.json), which
only the deployment's user (or root) may use: `POST /v1/scale {"decode": 2}`; with --wait it then reads
`GET /v1/deployment` until every pool has its new size, its new workers ready and its removed ones gone.
"""

import argparse
import json
import sys
import time

from services.cli.up import add_run_dir_option

WAIT_DEFAULT_S = 300.0


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "scale",
        help="add or remove decode and prefill workers of the running deployment",
        description="Set the running deployment's pool sizes: new workers start and serve once loaded; removed ones "
        "drain (their streams finish or move to another worker) and exit. Only the decode and prefill pools scale "
        "so far (a pipeline's stages and the kv-store do not yet). `splitserve ps` shows desired vs running.",
    )
    parser.add_argument("counts", nargs="+", metavar="ROLE=N", help="a pool's new size, e.g. decode=2 prefill=1")
    parser.add_argument("--model", metavar="NAME", help="the model whose pools to scale, by its served name "
                        "(`splitserve models served`; default: the deployment's first model)")
    add_run_dir_option(parser)
    add_wait_options(parser, run)


def add_wait_options(parser, run) -> None:
    """--wait, --timeout and --json, and the command's `run`."""
    parser.add_argument("--wait", action="store_true", help="return once every pool has its new size and its "
                        "workers are ready")
    parser.add_argument("--timeout", type=float, default=WAIT_DEFAULT_S, metavar="S",
                        help=f"with --wait: give up after S seconds (default {WAIT_DEFAULT_S:g})")
    parser.add_argument("--json", action="store_true", help="print the launcher's answers as JSON")
    parser.set_defaults(run=run)


def _fail(message: str, code: int = 1) -> int:
    print(f"splitserve scale: error: {message}", file=sys.stderr)
    return code


def control_socket(run_dir) -> str:
    """The running deployment's control socket; ValueError saying why there is none."""
    from services.launcher.deployment import DeploymentError, read_deployment

    try:
        dep = read_deployment(run_dir)
    except DeploymentError as exc:
        if isinstance(exc.__cause__, PermissionError):
            raise ValueError(f"not permitted: the deployment in {run_dir} is another user's (only its user or root "
                             "may scale it)") from None
        raise ValueError(str(exc)) from None
    if dep is None or not dep.launcher_alive():
        raise ValueError(f"no deployment is running in {run_dir} (start one with `splitserve up`, or pass --run-dir)")
    if dep.state == "starting":
        raise ValueError(f"the deployment in {run_dir} is still starting; scale it once it is ready")
    if not dep.control_socket:
        raise ValueError(f"the deployment in {run_dir} has no control API (its launcher predates `splitserve scale`,"
                         " or is stopping)")
    return dep.control_socket


def wait_settled(path: str, timeout_s: float) -> dict | None:
    """The deployment's view once settled; None at the deadline."""
    from services.launcher.control_client import call

    deadline = time.monotonic() + timeout_s
    while True:
        status, view = call(path, "GET", "/v1/deployment", timeout_s=10)
        if status == 200 and view.get("settled"):
            return view
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    from services.launcher.deployment import resolve_run_dir
    from services.launcher.scale_policy import ScaleError, parse_counts

    try:
        counts = parse_counts(args.counts)
        path = control_socket(resolve_run_dir(args.run_dir))
    except ScaleError as exc:
        return _fail(str(exc), 2)
    except ValueError as exc:
        return _fail(str(exc))
    body = {**counts, **({"model": args.model} if args.model else {})}
    return post(path, "/v1/scale", body, args, _fail, lambda answer: (
        f"scaling {'' if not args.model else 'model ' + answer['model'] + ' '}to "
        f"{', '.join(f'{r}={n}' for r, n in answer['desired'].items())}: starting "
        f"{', '.join(answer['starting']) or 'none'}; retiring {', '.join(answer['retiring']) or 'none'}"))


def post(path: str, route: str, body: dict, args: argparse.Namespace, fail, describe, timeout_s: float = 30.0) -> int:
    """POST `body` to the control API, say its answer (`describe(answer)`, or JSON), and with --wait `settle`."""
    from services.launcher.control_client import ControlUnavailable, call

    try:
        status, answer = call(path, "POST", route, body, timeout_s=timeout_s)
        if status != 200:
            return fail(answer.get("error", f"the launcher answered {status}"), 2 if status == 400 else 1)
        print(json.dumps(answer) if args.json else describe(answer))
        return settle(path, args, fail) if args.wait else 0
    except ControlUnavailable as exc:
        return fail(str(exc))


def settle(path: str, args: argparse.Namespace, fail) -> int:
    """--wait: until every pool has its size and its workers are ready (`fail(message)` at the deadline)."""
    view = wait_settled(path, args.timeout)
    if view is None:
        return fail(f"the deployment did not settle within {args.timeout:g} s (see `splitserve ps`)")
    pools = view["models"].get(getattr(args, "model", None) or "", view)  # the model scaled (the first: the top)
    print(json.dumps(view) if args.json else
          "settled: " + ", ".join(f"{role} {pools['ready'].get(role, 0)} ready of {n}"
                                  for role, n in pools["desired"].items()))
    return 0
