"""A peer's OpenAI-compatible server run by the peer benchmark: vLLM's CPU build or `transformers serve`.

Each runs from the peer venv (`loadtest/peer_venv.py`) in its own process group, its output in a log file,
and is ready when GET /health answers 200. It has the methods of `UpProcess` the benchmark uses (`start`,
`wait_ready`, `stop`, `base_url`, `served_name`), so a peer and a splitserve deployment are driven alike.

Both get a splitserve worker's limits (`engine_limits()`): the same KV cache bytes, sequences and tokens per
step, and context length. Each uses the cores it is given (the affinity it inherits) its own way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from loadtest.peer_venv import PeerVenv
from services.common.free_port import free_port

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def engine_limits() -> dict[str, int]:
    """A splitserve worker's defaults (its own flags, parsed empty): kv_cache_bytes, max_num_seqs,
    max_num_batched_tokens, block_size. The KV cache size follows SPLITSERVE_KV_CACHE_BYTES."""
    from services.common.service_settings import EngineSettings
    from services.common.settings import settings_from

    defaults = settings_from(EngineSettings)
    return {key: getattr(defaults, key) for key in ("kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens",
                                                    "block_size")}


class PeerServer:
    def __init__(self, label: str, cmd: list[str], env: dict[str, str], *, served_name: str, port: int,
                 log_path: Path, stop_timeout_s: float = 30.0):
        self.label = label
        self.cmd = cmd
        self.env = env
        self.served_name = served_name
        self.port = port
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.preload_notes: dict | None = None  # vllm-tuned's: the libraries preloaded, and those missing
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until GET /health answers 200; raises if the server exits first or the deadline passes."""
        import httpx

        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            time.sleep(1.0)
        raise RuntimeError(f"{self.label} was not ready within {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> dict[str, Any]:
        """SIGTERM the server's process group and wait; past the deadline SIGKILL the group."""
        result: dict[str, Any] = {"clean": True, "exit_code": None, "seconds": 0.0, "killed": []}
        if self.proc is None:
            return result
        started = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            result["clean"] = False
        # Its children (vLLM's engine core and worker) share the group: none may outlive the run.
        deadline = time.monotonic() + (5.0 if result["clean"] else 0.0)
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.proc.pid):
            result["clean"] = False
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            result["killed"].append(f"{self.label} (pgid {self.proc.pid})")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        result["exit_code"] = self.proc.poll()
        result["seconds"] = time.monotonic() - started
        return result


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def tuned_preload(venv: PeerVenv) -> tuple[list[str], list[str]]:
    """What vLLM's CPU documentation preloads for its best speed: tcmalloc (the distribution's package,
    libtcmalloc-minimal4, where present) and Intel's OpenMP runtime (PyPI's intel-openmp, in the peer venv).
    Returns the libraries found and a note for each one missing."""
    found, missing = [], []
    tcmalloc = next((path for path in TCMALLOC_PATHS if Path(path).is_file()), None)
    if tcmalloc:
        found.append(tcmalloc)
    else:
        missing.append("tcmalloc: not installed (the distribution's libtcmalloc-minimal4); glibc malloc instead")
    iomp = sorted(venv.path.glob("lib/libiomp5.so")) + sorted(venv.path.glob("lib/python*/site-packages/**/libiomp5.so"))
    if iomp:
        found.append(str(iomp[0]))
    else:
        missing.append("Intel OpenMP: libiomp5.so not in the peer venv (pip install intel-openmp); GNU OpenMP instead")
    return found, missing


def vllm_server(venv: PeerVenv, model_dir: str, *, dtype: str, max_model_len: int, log_dir: Path,
                omp_bind: str = "auto", label: str = "vllm", preload: list[str] | None = None) -> PeerServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free port with its own CPU placement by default
    (VLLM_CPU_OMP_THREADS_BIND=auto: OpenMP threads bound to the cores it may use but one, kept for its API
    server and engine core; on 2 cores, one thread) or `omp_bind` (e.g. "0-1": a compute thread on every
    core), prefix caching on (as splitserve's), a KV cache of splitserve's size (VLLM_CPU_KVCACHE_SPACE, whole
    GiB), and `preload` (libraries, e.g. `tuned_preload`'s) in LD_PRELOAD."""
    limits = engine_limits()
    if limits["kv_cache_bytes"] % (1 << 30):
        raise ValueError(f"vLLM's CPU KV cache is set in whole GiB; splitserve's is {limits['kv_cache_bytes']} bytes")
    port = free_port()
    cmd = [str(venv.python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "bench", "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(limits["max_num_seqs"]),
           "--max-num-batched-tokens", str(limits["max_num_batched_tokens"]),
           "--enable-prefix-caching", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(limits["kv_cache_bytes"] >> 30),
               VLLM_CPU_OMP_THREADS_BIND=omp_bind, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # nothing of the project's may shadow the venv's packages
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return PeerServer(f"{label}-{dtype}", cmd, env, served_name="bench", port=port,
                      log_path=log_dir / f"{label}-{dtype}.log")


def transformers_server(venv: PeerVenv, model_dir: str, *, dtype: str, log_dir: Path) -> PeerServer:
    """`transformers serve --continuous-batching` on a free port, the model preloaded, a KV cache of
    splitserve's block size and bytes, and vLLM's placement rule: a torch thread per core it may use but one,
    left to its HTTP server (torch's default, a thread per core, oversubscribes 2 cores: one stream ran 4x
    slower).

    It reads the model's class from config.json's `architectures`, which a converted model may lack: then it
    serves a copy of the directory (links to the files, a config naming the class) made under `log_dir`."""
    limits = engine_limits()
    served = _with_architectures(Path(model_dir), log_dir / "transformers-model")
    # Its KV cache is sized in blocks (by default it takes 90% of the machine's RAM): splitserve's bytes.
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    bytes_per_block = config["num_hidden_layers"] * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype] * limits["block_size"]
    port = free_port()
    cmd = [str(venv.path / "bin" / "transformers"), "serve", str(served), "--continuous-batching",
           "--device", "cpu", "--dtype", dtype, "--cb-block-size", str(limits["block_size"]),
           "--cb-num-blocks", str(limits["kv_cache_bytes"] // bytes_per_block),
           "--cb-max-batch-tokens", str(limits["max_num_batched_tokens"]),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    threads = str(max(1, len(os.sched_getaffinity(0)) - 1))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return PeerServer(f"transformers-{dtype}", cmd, env, served_name=str(served), port=port,
                      log_path=log_dir / f"transformers-{dtype}.log")


def _with_architectures(model_dir: Path, copy_dir: Path) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    if architecture is None:
        raise RuntimeError(f"{model_dir}/config.json names no architecture and its model_type "
                           f"{config.get('model_type')!r} is not a causal LM transformers knows")
    copy_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        link = copy_dir / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    (copy_dir / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}, indent=2))
    return copy_dir
