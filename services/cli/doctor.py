"""`splitserve doctor`: check the machine and its surroundings before deploying."""

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

UP_SETTINGS_CHECKED = ("model", "nats", "host", "port", "gpu_memory_utilization")
UP_FIELDS = {"model": "models"}  # doctor's --model is up's (first) --model
STATUS_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def add_parser(subcommands) -> None:
    from services.cli.up import add_run_dir_option

    parser = subcommands.add_parser(
        "doctor",
        help="check GPUs, interconnect, CPU, disk, NATS, the API port, the model and libraries",
        description="The environment checklist to run before deploying: GPUs and their memory, the GPU "
                    "interconnect (NVLink or PCIe), driver and CUDA versions, CPU cores and NUMA nodes, free disk for "
                    "models and KV spill, the NATS server (with JetStream), the API port, the model directory and "
                    "library versions. On a machine without a GPU it says so and checks the rest.",
    )
    # What `up` would use, from the same flags, SPLITSERVE_* variables and --config file (`up`'s settings).
    parser.add_argument("--model", metavar="NAME|DIR|FILE.gguf",
                        help="the model to serve: a known name, a directory or a .gguf file (default: `up`'s)")
    parser.add_argument("--nats", metavar="URL", help="an existing NATS server to check (default: `up`'s; none: the "
                                                      "embedded one)")
    parser.add_argument("--nats-creds", metavar="FILE",
                        help="credentials for --nats: an NKey seed or .creds file (or SPLITSERVE_NATS_CREDS)")
    parser.add_argument("--host", help="the address the API will listen on (default: `up`'s)")
    parser.add_argument("--port", type=int, help="the port the API will listen on (default: `up`'s)")
    parser.add_argument("--kv-store-dir", help="where the kv-store's disk tier will live")
    parser.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                        help="the share of each GPU's memory a model worker will ask (default: `up`'s): is it free?")
    parser.add_argument("--config", metavar="FILE.yaml", help="`up`'s config file, read as `up` reads it "
                                                              "(default: $SPLITSERVE_CONFIG)")
    parser.add_argument("--min-free-gib", type=float, default=10.0, help="warn below this much free disk")
    add_run_dir_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def up_settings_of(args: argparse.Namespace, environ: Mapping[str, str] | None = None):
    """The settings `up` would run with, given doctor's flags for the ones both take."""
    from services.common.settings import settings_from
    from services.launcher.up_settings import UpSettings

    environ = os.environ if environ is None else environ
    given = {UP_FIELDS.get(name, name): getattr(args, name) for name in UP_SETTINGS_CHECKED
             if getattr(args, name) is not None}
    return settings_from(UpSettings, argparse.Namespace(**given), args.config or environ.get("SPLITSERVE_CONFIG"),
                         environ)


def run(args: argparse.Namespace) -> int:
    from services.common.settings import SettingsError
    from services.doctor import checks
    from services.launcher.deployment import resolve_run_dir
    from shared.engine import cache_root

    try:
        up = up_settings_of(args)
    except SettingsError as exc:
        print(f"splitserve doctor: error: {exc}", file=sys.stderr)
        return 2
    checked = {name: up.first_model if name == "model" else getattr(up, name) for name in UP_SETTINGS_CHECKED}
    args = argparse.Namespace(**{**vars(args), **checked})
    run_dir = resolve_run_dir(args.run_dir or up.run_dir)
    places = {"run directory": run_dir}
    places["model"] = Path(args.model) if args.model and Path(args.model).is_dir() else cache_root() / "models"
    if args.kv_store_dir:
        places["kv-store"] = Path(args.kv_store_dir)
    results = [
        *checks.gpus(), *checks.gpu_memory(args.gpu_memory_utilization), *checks.cpu(), *checks.disk(places, int(args.min_free_gib * 2**30)),
        *checks.nats_server(args.nats, creds_file=args.nats_creds), *checks.api_port(args.host, args.port, run_dir), *checks.model(args.model),
        *checks.libraries(),
    ]
    if args.json:
        print(json.dumps({"checks": [vars(c) for c in results],
                          "ok": not any(c.status == "fail" for c in results)}, indent=2))
    else:
        width = max(len(c.name) for c in results)
        for check in results:
            first, *rest = check.detail.splitlines() or [""]
            print(f"[{STATUS_MARK[check.status]}] {check.name.ljust(width)}  {first}")
            for line in rest:
                print(f"       {' ' * width}  {line}")
    return 1 if any(c.status == "fail" for c in results) else 0


