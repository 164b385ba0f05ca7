"""What `splitserve up` checks before it starts anything, and the launch's error: the settings as a whole, the
port, the model, CUDA; and a probe of a service's health URL."""

from __future__ import annotations

import errno
import socket
import urllib.error
import urllib.request
from pathlib import Path

from services.launcher import topology
from services.launcher.model_spec import check_served_names
from services.launcher.planner_spec import check_planner
from services.launcher.served_models import check_topology
from services.launcher.up_settings import UpSettings
from shared.bus.connection import nats_endpoints
from shared.bus.provision import ProvisionError, replicas_for


class LaunchError(Exception):
    """A reason to stop with a one-line message (no traceback) and an exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_settings(o: UpSettings) -> None:
    """LaunchError (exit 2) naming what in `up`'s settings cannot work, before anything is started."""
    from contracts.subjects import check_token

    try:
        check_token(o.namespace, "namespace")
    except ValueError as exc:
        raise LaunchError(str(exc), 2) from None
    try:
        check_topology(o)
        check_planner(o)
        check_served_names([spec.name for spec in o.further_models if spec.name is not None])
    except ValueError as exc:
        raise LaunchError(str(exc), 2) from None
    wants_cuda = bool({o.device, o.prefill_device, o.decode_device} - {None, "cpu"})
    try:
        topology.check_devices(o.topology, o.device, o.prefill_device, o.decode_device, o.gpu_memory_utilization,
                               cuda_devices() if wants_cuda else 0,
                               pipelined=o.topology == "pipeline" or o.prefill_stages is not None)
    except ValueError as exc:
        raise LaunchError(str(exc), 2) from None
    if not 0 < o.port < 65536:
        raise LaunchError(f"--port {o.port} is not a TCP port", 2)
    if o.nats is not None:
        try:
            nats_endpoints(o.nats)
        except ValueError as exc:
            raise LaunchError(str(exc), 2) from None
    if o.tls and o.nats is not None:
        raise LaunchError("--tls makes the embedded server's certificate; for a --nats server give its CA "
                          "with --nats-tls-ca", 2)
    if o.nats is not None and o.nats_cluster != 1:
        raise LaunchError("--nats-cluster starts embedded servers; with --nats give every server's URL "
                          "(URL,URL,...)", 2)
    if o.nats is None:
        try:
            replicas_for(o.nats_replicas, o.nats_cluster)
        except (ProvisionError, ValueError) as exc:
            raise LaunchError(str(exc) + " (--nats-cluster N starts N)", 2) from None
    if o.nats_tls_ca is not None and o.nats is None:
        raise LaunchError("--nats-tls-ca is for a --nats server; the embedded one gets --tls", 2)
    if o.nats_creds_dir is not None:
        if o.nats is None:
            raise LaunchError("--nats-creds-dir is for a --nats server; the embedded one gets its own", 2)
        if not Path(o.nats_creds_dir).is_dir():
            raise LaunchError(f"--nats-creds-dir {o.nats_creds_dir} is not a directory "
                              "(`splitserve nats-auth DIR` writes one)", 2)


def cuda_devices() -> int:
    """How many CUDA devices torch sees here (0 without a GPU or with torch's CPU build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_port_free(host: str, port: int) -> None:
    """Raise LaunchError (exit 2) unless a server could listen on host:port."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror}", 2) from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            # As uvicorn does; still refused on Linux while another socket listens.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
                sock.listen(1)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise LaunchError(f"port {port} on {host} is already in use", 2) from None
                raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", 2) from None


def probe_health(url: str, timeout_s: float = 2.0) -> tuple[int | None, str]:
    """(HTTP status or None, a short description of the answer)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return resp.status, resp.read(4096).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read(4096).decode(errors="replace")
        except OSError:
            body = ""
        return exc.code, body
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, str(reason)


def resolve_model(model: str | None, served_model_name: str | None, say) -> tuple[str, str]:
    """(model directory, served name) of --model, or of the default model without one.

    A known name is fetched into the cache on first use, a .gguf file
    converted once (`shared.engine.model_registry`); `say` tells what it does.
    """
    from shared.engine import ModelFetchError, ModelLoadError, resolve_model as resolve

    try:
        resolved = resolve(model, say=say)
    except ModelLoadError as exc:
        raise LaunchError(str(exc), 1 if isinstance(exc, ModelFetchError) else 2) from None
    if not (resolved.model_dir / "config.json").is_file():
        raise LaunchError(f"{resolved.model_dir} is not a Hugging Face model directory (it has no config.json)", 2)
    return str(resolved.model_dir), served_model_name or resolved.served_model_name
