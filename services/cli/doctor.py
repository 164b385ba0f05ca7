"""`splitserve doctor`: check the machine and its surroundings before deploying."""

import argparse
import json
from pathlib import Path

STATUS_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def add_parser(subcommands) -> None:
    from services.cli.up import add_run_dir_option
    from services.launcher.up_settings import UpSettings

    up = UpSettings.model_fields

    parser = subcommands.add_parser(
        "doctor",
        help="check GPUs, interconnect, CPU, disk, NATS, the API port, the model and libraries",
        description="The environment checklist to run before deploying: GPUs and their memory, the GPU "
                    "interconnect (NVLink or PCIe), driver and CUDA versions, CPU cores and NUMA nodes, free disk for "
                    "models and KV spill, the NATS server (with JetStream), the API port, the model directory and "
                    "library versions. On a machine without a GPU it says so and checks the rest.",
    )
    parser.add_argument("--model", metavar="NAME|DIR|FILE.gguf",
                        help="the model to serve: a known name, a directory or a .gguf file "
                             "(default: smollm2-135m-instruct)")
    parser.add_argument("--nats", metavar="URL", help="an existing NATS server to check (default: the embedded one)")
    parser.add_argument("--nats-creds", metavar="FILE",
                        help="credentials for --nats: an NKey seed or .creds file (or SPLITSERVE_NATS_CREDS)")
    parser.add_argument("--host", default=up["host"].default, help="the address the API will listen on (default: "
                                                                    "`up`'s)")
    parser.add_argument("--port", type=int, default=up["port"].default, help="the port the API will listen on "
                                                                             "(default: `up`'s)")
    parser.add_argument("--kv-store-dir", help="where the kv-store's disk tier will live")
    parser.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                        help="the share of each GPU's memory a model worker will ask (as `up` takes it): is it free?")
    parser.add_argument("--min-free-gib", type=float, default=10.0, help="warn below this much free disk")
    add_run_dir_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from services.doctor import checks
    from services.launcher.deployment import resolve_run_dir
    from shared.engine.default_model import cache_root

    run_dir = resolve_run_dir(args.run_dir)
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


