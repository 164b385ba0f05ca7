"""Flags every service takes; each also reads a SPLITSERVE_* environment variable."""

import argparse
import os
import socket


def env_default(name: str, default):
    return os.environ.get(f"SPLITSERVE_{name}", default)


def add_bus_options(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--nats", default=env_default("NATS_URL", "nats://127.0.0.1:4222"),
                        help="NATS server URL; a cluster's as URL,URL,... (the client fails over between them)")
    replicas = env_default("NATS_REPLICAS", None)
    parser.add_argument("--nats-replicas", type=int, default=int(replicas) if replicas else None, metavar="N",
                        help="copies of each JetStream stream and bucket this service creates or updates (also "
                             "SPLITSERVE_NATS_REPLICAS; default: 3 on a cluster of 3 nodes or more, else 1)")
    parser.add_argument("--nats-creds", metavar="FILE",
                        help="this service's NATS credentials: an NKey seed file or a .creds file (also "
                             "SPLITSERVE_NATS_CREDS; or the seed itself in SPLITSERVE_NATS_NKEY_SEED)")
    parser.add_argument("--nats-tls-ca", metavar="FILE",
                        help="talk TLS to NATS, trusting only this CA (also SPLITSERVE_NATS_TLS_CA)")
    parser.add_argument("--nats-tls-cert", metavar="FILE", help="a client certificate for NATS (SPLITSERVE_NATS_TLS_CERT)")
    parser.add_argument("--nats-tls-key", metavar="FILE", help="its key (SPLITSERVE_NATS_TLS_KEY)")
    parser.add_argument("--namespace", default=env_default("NAMESPACE", "splitserve"), help="subject prefix of this deployment")
    parser.add_argument(
        "--instance-id",
        default=env_default("INSTANCE_ID", f"{role}-{socket.gethostname()}-{os.getpid()}"),
        help="unique name of this service instance (letters, digits, '_' and '-')",
    )
    parser.add_argument("--log-level", default=env_default("LOG_LEVEL", "info"), choices=["debug", "info", "warning", "error"])
    if role != "gateway":  # the gateway's own HTTP server has /health and /ready
        port = env_default("STATUS_PORT", None)
        parser.add_argument("--status-port", type=int, default=int(port) if port else None, metavar="PORT",
                            help="serve GET /health (liveness) and GET /ready (readiness) for probes on this port "
                                 "(also SPLITSERVE_STATUS_PORT; default: none)")
        parser.add_argument("--status-host", default=env_default("STATUS_HOST", "127.0.0.1"), metavar="ADDR",
                            help="the address the status endpoint listens on (default: 127.0.0.1; 0.0.0.0 for a "
                                 "kubelet's probes)")


def bus_credentials(args: argparse.Namespace):
    """The service's NATS credentials (see `shared.bus.credentials`), checked now: exits if they are unusable."""
    from shared.bus.credentials import CredentialsError, credentials_from

    credentials = credentials_from(args.nats_creds)
    try:
        credentials.connect_options()
    except CredentialsError as exc:
        raise SystemExit(f"error: {exc}") from None
    return credentials


def bus_tls(args: argparse.Namespace):
    """The NATS connection's TLS context (see `shared.bus.tls`), or None; exits if the files are unusable."""
    from shared.bus.tls import TLSConfigError, client_tls_context

    try:
        return client_tls_context(args.nats_tls_ca, args.nats_tls_cert, args.nats_tls_key)
    except TLSConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


def add_side_channel_options(parser: argparse.ArgumentParser) -> None:
    """For services with a side channel (model workers, the kv-store): where it is reached, TLS on it."""
    parser.add_argument("--advertise-host", default=env_default("ADVERTISE_HOST", None), metavar="ADDR",
                        help="the address other hosts reach this service's side channel at, which it listens on "
                             "(also SPLITSERVE_ADVERTISE_HOST; default: the address of the interface that routes "
                             "to NATS, 127.0.0.1 beside a local NATS)")
    parser.add_argument("--transfer-tls-ca", metavar="FILE",
                        help="side channel over TLS only: trust receivers whose certificate chains to this CA "
                             "(also SPLITSERVE_TRANSFER_TLS_CA; needs the two below)")
    parser.add_argument("--transfer-tls-cert", metavar="FILE",
                        help="the certificate this service's receivers present, naming the address they advertise "
                             "(SPLITSERVE_TRANSFER_TLS_CERT)")
    parser.add_argument("--transfer-tls-key", metavar="FILE", help="its key (SPLITSERVE_TRANSFER_TLS_KEY)")


def transfer_tls_of(args: argparse.Namespace):
    """The side channel's TLS (see `shared.transfer.tls`), or None; exits if the files are unusable."""
    from shared.transfer.tls import TransferTLSError, transfer_tls

    try:
        return transfer_tls(args.transfer_tls_ca, args.transfer_tls_cert, args.transfer_tls_key)
    except TransferTLSError as exc:
        raise SystemExit(f"error: {exc}") from None


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=env_default("MODEL", None), metavar="NAME|DIR|FILE.gguf",
                        help="a known model's name (fetched into the cache on first use), a Hugging Face model "
                             "directory or a .gguf file (default: smollm2-135m-instruct)")
    parser.add_argument("--served-model-name", default=env_default("SERVED_MODEL_NAME", None), help="the name clients ask for")
    parser.add_argument("--dtype", default=env_default("DTYPE", "auto"), choices=["auto", "float32", "bfloat16", "float16"])


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(model directory, served model name) of --model (see `shared.engine.model_registry`); exits if it names none."""
    from shared.engine.errors import ModelLoadError
    from shared.engine.model_registry import resolve_model as resolve

    try:
        resolved = resolve(args.model)
    except ModelLoadError as exc:
        raise SystemExit(f"error: {exc}") from None
    return str(resolved.model_dir), args.served_model_name or resolved.served_model_name


def run_async(coro) -> int:
    """Run a service's main coroutine on uvloop (the design's event loop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The model runner's settings, shared by every worker that embeds the engine."""
    parser.add_argument("--device", default=env_default("DEVICE", "cpu"), help="cpu, cuda or cuda:N")
    from shared.engine.defaults import (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_KV_CACHE_BYTES,
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        DEFAULT_MAX_NUM_SEQS,
    )

    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    parser.add_argument("--kv-cache-bytes", type=int, default=int(env_default("KV_CACHE_BYTES", DEFAULT_KV_CACHE_BYTES)),
                        help=f"memory for the paged KV cache (default: {DEFAULT_KV_CACHE_BYTES >> 20} MiB)")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                        help=f"sequences in one step at most (default: {DEFAULT_MAX_NUM_SEQS})")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"tokens in one step at most (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--prefill-beside-decodes-ms", type=_positive_ms, metavar="MS",
                        default=env_default("PREFILL_BESIDE_DECODES_MS", None),
                        help="stall-free chunking: a step that carries decodes lasts about MS, with the prompt chunks "
                             "that fit beside them (costs learnt from the steps), so a long prompt never stalls running requests' tokens "
                             "(default: off, the whole --max-num-batched-tokens)")
    parser.add_argument("--cpus", type=_cpu_list, default=env_default("CPUS", None), metavar="LIST",
                        help="run the worker's threads on these CPUs (e.g. 0-3 or 0,2), one torch thread each "
                             "(default: wherever the OS places them, torch's default thread count)")


def checked_type(convert, ok, kind: str):
    """An argparse type: `convert` the text, then require `ok(value)`, naming `kind` in the error."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {kind}")
        return value

    return parse


factor_or_off = checked_type(float, lambda v: 0 <= v < float("inf"), "a number of at least 0 (0: off)")
count = checked_type(int, lambda v: v >= 0, "a whole number of at least 0")
seconds = checked_type(float, lambda v: 0 <= v < float("inf"), "a number of seconds, at least 0")
positive_seconds = checked_type(float, lambda v: 0 < v < float("inf"), "a number of seconds, more than 0")


def _positive_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of milliseconds")
    return value


def _cpu_list(text: str) -> tuple[int, ...]:
    from services.common.cpus import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_cpu_loan_options(parser: argparse.ArgumentParser, *, borrower: bool) -> None:
    """A prefill worker lends its CPUs while idle to a decode worker on the same host, which borrows them
    (`services.common.cpu_loan`); both name the same loan file."""
    if borrower:
        parser.add_argument("--borrow-cpus", type=_cpu_list, metavar="LIST",
                            help="also run decode steps on these CPUs (a prefill worker's --cpus) while the prefill "
                                 "worker lending them through --cpu-loan is idle; needs --cpus")
        parser.add_argument("--cpu-loan", metavar="FILE", help="the loan file the lending prefill worker creates")
    else:
        parser.add_argument("--cpu-loan", metavar="FILE",
                            help="lend this worker's --cpus, while it has nothing to compute, to the decode worker "
                                 "borrowing through FILE (created here, mode 0600)")


def apply_engine_placement(args: argparse.Namespace) -> None:
    """Bind the worker to its --cpus (see `services.common.cpus`); call first thing in a worker's main. A
    borrower's lent CPUs are added to its engine thread's team later (`services.common.cpu_loan`)."""
    from services.common.cpus import bind_cpus

    borrowed = getattr(args, "borrow_cpus", None)
    if borrowed is not None or (getattr(args, "cpu_loan", None) and hasattr(args, "borrow_cpus")):
        from services.common.cpu_loan import check_borrowing

        try:
            check_borrowing(args.cpus, borrowed, args.cpu_loan)
        except ValueError as exc:
            raise SystemExit(f"splitserve: {exc}") from None
    elif getattr(args, "cpu_loan", None) and not args.cpus:
        raise SystemExit("splitserve: --cpu-loan lends this worker's --cpus: give them")
    if args.cpus:
        bind_cpus(args.cpus)


def engine_config(args: argparse.Namespace, model_dir: str):
    from shared.engine.config import EngineConfig

    return EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        prefill_beside_decodes_ms=args.prefill_beside_decodes_ms,
    )


def add_kv_store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-store", action="store_true",
                        help="use the deployment's kv-store: load cached prompt prefixes from it, write computed "
                             "blocks back to it")
    parser.add_argument("--kv-store-timeout", type=float, default=5.0,
                        help="seconds a kv-store lookup or transfer may take before the worker computes instead")
    parser.add_argument("--kv-store-receiver-host", default=env_default("KV_RECEIVER_HOST", None),
                        help="address the side channel that takes blocks from the kv-store listens on "
                             "(default: --advertise-host's)")
    parser.add_argument("--kv-store-receiver-advertise", default=env_default("KV_RECEIVER_ADVERTISE", None),
                        help="the address the kv-store dials (needed when listening on 0.0.0.0)")


def side_channel_address(args: argparse.Namespace, listen: str | None, advertise: str | None) -> tuple[str, str | None]:
    """(listen on, advertise) for one of the service's receivers (see `services.common.advertise`)."""
    from services.common.advertise import route_address, side_channel_addresses

    return side_channel_addresses(listen, advertise, args.advertise_host, lambda: route_address(args.nats))
