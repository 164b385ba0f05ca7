"""`splitserve up`: the whole deployment on this machine, supervised.

The work is in `services.launcher.launcher`; this module is the flags.
"""

import argparse
import os

from services.common.options import checked_type, count, factor_or_off
from services.gateway.request_bus import DEFAULT_MIGRATION_LIMIT
from services.gateway.streams import DEFAULT_MAX_WAITING_REQUESTS
from services.launcher.deployment import DEFAULT_RUN_DIR, RUN_DIR_ENV
from services.launcher.topology import DISAGG_PREFILL_BESIDE_DECODES_MS

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def take_gateway_api_keys(flags: list[str] | None) -> tuple[str, ...]:
    """The gateway's API keys (--api-key, SPLITSERVE_API_KEY). The variable leaves this process's environment,
    which every service inherits: the launcher hands the keys to the gateway alone."""
    from services.gateway.edge import parse_api_keys

    return parse_api_keys(flags, os.environ.pop("SPLITSERVE_API_KEY", None))


_positive_int = checked_type(int, lambda v: v >= 1, "a whole number of at least 1")
_port = checked_type(int, lambda v: 0 < v < 65536, "a port number (1-65535)")
_seconds = checked_type(float, lambda v: v > 0, "a positive number of seconds")
_milliseconds_or_off = checked_type(float, lambda v: v >= 0 and v == v and v != float("inf"),
                                "a number of milliseconds (0: off)")


def _cpus(text: str) -> str:
    from services.common.cpus import worker_cpus

    try:
        worker_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_run_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help=(
            "where the deployment keeps its state (deployment.json), logs (logs/NAME.log) and the "
            f"embedded NATS data (default: ${RUN_DIR_ENV}, else ./{DEFAULT_RUN_DIR})"
        ),
    )


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "up",
        help="run a whole deployment on this machine (embedded NATS and every service)",
        description=(
            "Start an embedded NATS server with JetStream (unless --nats is given), then the scheduler, "
            "the decode workers and the gateway as supervised child processes (a service that crashes is "
            "restarted). Prints one line with the API URL once the gateway's /ready says every service is ready, "
            "then keeps running; Ctrl-C or SIGTERM stops everything. `splitserve ps` shows what runs."
        ),
    )
    parser.add_argument("--model", metavar="NAME|DIR|FILE.gguf",
                        help="a known model's name (`splitserve models list`; fetched into the cache on first use), "
                             "a Hugging Face model directory or a .gguf file, converted once into the cache "
                             "(default: smollm2-135m-instruct)")
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients ask for (default: a known model's name, else the directory's or file's name)",
    )
    parser.add_argument("--topology", default="disagg", choices=["colocated", "disagg", "pipeline"],
                        help="how inference is split: colocated workers, separate prefill and decode pools, or "
                             "the model's layers over pipeline stages (default: disagg, one prefill and one decode worker)")
    parser.add_argument("--decode", type=_positive_int, default=1, metavar="N", help="number of decode workers (default: 1)")
    parser.add_argument("--prefill", type=_positive_int, default=1, metavar="N",
                        help="number of prefill workers with --topology disagg (default: 1)")
    parser.add_argument("--max-local-prefill", type=int, metavar="N",
                        help="disagg: prompts with more uncached tokens than N are prefilled remotely (0: always)")
    parser.add_argument("--offload-short-prefills", action=argparse.BooleanOptionalAction, default=True,
                        help="disagg: a shorter prompt goes to an idle prefill worker too while its decode worker "
                             "is busy streaming (default: on)")
    parser.add_argument("--migration-limit", type=count, metavar="N",
                        help="times a request moves to another worker, from the tokens its client has, when its "
                             "worker fails under it (0: it fails instead; default: the gateway's, "
                             f"{DEFAULT_MIGRATION_LIMIT})")
    parser.add_argument("--max-waiting-requests", type=count, metavar="N",
                        help="admission control: with N requests still waiting for their first token, a new one "
                             f"gets 429 and Retry-After (0: no bound; default: the gateway's, {DEFAULT_MAX_WAITING_REQUESTS})")
    parser.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                        help="the gateway's chat template instead of the tokenizer's: a Jinja file, or the template "
                             "itself")
    parser.add_argument("--prefill-backlog-factor", type=factor_or_off, metavar="F",
                        help="disagg: a long prompt is prefilled by its decode worker when each prefill worker has "
                             "more than F times its tokens queued (e.g. 0.5; default 0: never)")
    parser.add_argument("--lend-idle-cpus", action=argparse.BooleanOptionalAction, default=True,
                        help="disagg: while a prefill worker has nothing to compute, its CPUs run its decode "
                             "worker's steps too, handed back before each prefill (default: on)")
    parser.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "tcp"],
                        help="disagg: how KV moves from prefill to decode workers (default: auto)")
    parser.add_argument("--stages", type=_positive_int, metavar="N",
                        help="pipeline: split the layers evenly over N stage processes (default: 2)")
    parser.add_argument("--layer-split", metavar="A:B,B:C,...",
                        help="pipeline: each stage's layers, e.g. 0:6,6:12 (instead of --stages)")
    parser.add_argument("--prefill-stages", type=_positive_int, metavar="N",
                        help="disagg: the prefill pool is one pipeline of N stages, each shipping its own layers' "
                             "KV to the decode workers (with --prefill 1)")
    parser.add_argument("--microbatches", type=_positive_int, default=2, metavar="M",
                        help="pipeline: steps in flight through the stages at once (default: 2)")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N",
                        help="every worker's token budget per step: long prompts are prefilled in chunks of at "
                             "most N tokens, mixed with decodes (default: the engine's, 2048)")
    parser.add_argument("--prefill-beside-decodes-ms", type=_milliseconds_or_off, metavar="MS",
                        help="decode workers' stall-free chunking: a step carrying decodes lasts about MS, with the "
                             "prompt chunks that fit beside them, so a prompt prefilled on a decode worker never stalls the others' tokens "
                             f"(default: {DISAGG_PREFILL_BESIDE_DECODES_MS:g} in disagg, off in colocated; 0: off)")
    parser.add_argument("--kv-store", action=argparse.BooleanOptionalAction, default=None,
                        help="run a kv-store: workers load cached prompt prefixes from it and write computed blocks "
                             "back, so a prefix is computed once for all workers (default: on with disagg; "
                             "--no-kv-store turns it off)")
    parser.add_argument("--router", default="kv", choices=["kv", "load"],
                        help="how the scheduler picks a worker: kv scores the prompt prefix each worker's cache "
                             "(and the kv-store) holds against its load; load takes the least loaded (default: kv)")
    parser.add_argument("--kv-store-ram-bytes", type=_positive_int, default=1 << 30, metavar="N",
                        help="the kv-store's RAM tier (default: 1 GiB)")
    parser.add_argument("--kv-store-disk-bytes", type=int, default=0, metavar="N",
                        help="the kv-store's disk tier, kept in the run directory (default: 0, none)")
    parser.add_argument("--trace-viewer", action="store_true",
                        help="run a local trace viewer (Arize Phoenix, on 127.0.0.1) and send every service's traces "
                             "to it (pip install 'splitserve[trace-viewer]')")
    parser.add_argument("--trace-viewer-port", type=_port, default=6006, metavar="PORT",
                        help="the trace viewer's UI and OTLP/HTTP port; OTLP/gRPC on the next one (default: 6006)")
    parser.add_argument("--api-key", action="append", metavar="KEY",
                        help="the gateway requires `Authorization: Bearer KEY` on /v1/* (repeatable; or "
                             "SPLITSERVE_API_KEY, comma-separated, which other local users cannot read)")
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="port the gateway listens on (default: 8000)")
    parser.add_argument("--nats", metavar="URL",
                        help="use this NATS server (with JetStream) instead of starting one; a cluster's as "
                             "URL,URL,...")
    parser.add_argument("--nats-cluster", type=_positive_int, default=1, metavar="N",
                        help="start N embedded NATS servers clustered on loopback (JetStream replicated; 3 rides "
                             "out the loss of one) instead of one (default: 1)")
    parser.add_argument("--nats-replicas", type=_positive_int, metavar="N",
                        help="copies of each JetStream stream and bucket (default: 3 on a cluster of 3 nodes or "
                             "more, else 1)")
    parser.add_argument("--nats-creds-dir", metavar="DIR",
                        help="with --nats: each service's credentials, DIR/ROLE.nk (`splitserve nats-auth DIR` "
                             "writes them and the server's authorization config)")
    parser.add_argument("--tls", action="store_true",
                        help="the embedded NATS server and every worker's KV side channel speak only TLS, with "
                             "certificates from a CA made for this deployment (RUN_DIR/tls); every service trusts "
                             "that CA alone")
    parser.add_argument("--nats-tls-ca", metavar="FILE", help="with --nats: talk TLS to it, trusting this CA")
    parser.add_argument("--nats-auth", action=argparse.BooleanOptionalAction, default=True,
                        help="the embedded NATS server admits only this deployment's services, each role with its "
                             "own credentials (RUN_DIR/creds) and only the subjects its job needs (default: on)")
    parser.add_argument("--namespace", default="splitserve", help="subject prefix of this deployment (default: splitserve)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="model weights' dtype (default: auto)")
    parser.add_argument("--cpus", default="auto", type=_cpus, metavar="auto|none|LIST",
                        help="CPUs the model workers share out, each its own contiguous part, one torch thread per "
                             "CPU (default: auto, every CPU this process may use; none: the OS places them)")
    add_run_dir_option(parser)
    parser.add_argument("--log-max-bytes", type=_positive_int, default=64 << 20, metavar="N",
                        help="each service's log (RUN_DIR/logs/NAME.log) rotates to NAME.log.1 past N bytes "
                             "(default: 64 MiB)")
    parser.add_argument("--log-backups", type=_positive_int, default=3, metavar="K",
                        help="rotated logs kept per service, NAME.log.1 to NAME.log.K (default: 3)")
    parser.add_argument(
        "--ready-timeout",
        type=_seconds,
        default=300.0,
        metavar="S",
        help="give up if the deployment is not ready after S seconds (default: 300)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from services.launcher.deployment import resolve_run_dir
    from services.launcher.launcher import Launcher, UpOptions, install_signal_handlers, restore_signal_handlers

    options = UpOptions(
        run_dir=resolve_run_dir(args.run_dir),
        model=args.model,
        served_model_name=args.served_model_name,
        topology=args.topology,
        decode=args.decode,
        prefill=args.prefill,
        max_local_prefill=args.max_local_prefill,
        offload_short_prefills=args.offload_short_prefills,
        prefill_backlog_factor=args.prefill_backlog_factor, migration_limit=args.migration_limit,
        max_waiting_requests=args.max_waiting_requests, chat_template=args.chat_template,
        lend_idle_cpus=args.lend_idle_cpus,
        kv_transport=args.kv_transport,
        stages=args.stages,
        layer_split=args.layer_split,
        microbatches=args.microbatches,
        prefill_stages=args.prefill_stages,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_beside_decodes_ms=args.prefill_beside_decodes_ms,
        kv_store=args.kv_store,
        router=args.router,
        trace_viewer=args.trace_viewer,
        trace_viewer_port=args.trace_viewer_port,
        kv_store_ram_bytes=args.kv_store_ram_bytes,
        kv_store_disk_bytes=args.kv_store_disk_bytes,
        api_keys=take_gateway_api_keys(args.api_key),
        host=args.host,
        nats_cluster=args.nats_cluster,
        nats_replicas=args.nats_replicas,
        port=args.port,
        nats=args.nats,
        nats_auth=args.nats_auth,
        nats_creds_dir=args.nats_creds_dir,
        tls=args.tls,
        nats_tls_ca=args.nats_tls_ca,
        namespace=args.namespace,
        dtype=args.dtype,
        cpus=args.cpus,
        ready_timeout_s=args.ready_timeout,
        log_max_bytes=args.log_max_bytes,
        log_backups=args.log_backups,
    )
    launcher = Launcher(options)
    previous = install_signal_handlers(launcher)
    try:
        return launcher.run()
    finally:
        restore_signal_handlers(previous)
