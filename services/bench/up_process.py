"""A `splitserve up` deployment run by a benchmark: start it, wait for its ready line, list and pin its
processes, and stop it so that none of them outlives the run."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from services.common.free_port import free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository


def popen_launch(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """`argv` as a subprocess in a session of its own, its output (both streams) a binary pipe."""
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


# How a deployment of this checkout starts: `popen_launch`'s signature and promises (a Popen-like process leading
# its own session, with `stdout` a binary pipe). The test suite starts it off its preloaded forkserver instead.
LAUNCH = popen_launch


class UpProcess:
    """One `splitserve up` subprocess, in its own process group, on a free port and a fresh namespace.

    `topology_args` are the topology's own flags (`--topology ... --decode 2`, ...).
    Its services run with OMP_NUM_THREADS=`worker_threads`.
    """

    def __init__(self, label: str, topology_args: list[str], *, model_dir: str, served_name: str, run_dir: Path,
                 dtype: str, worker_threads: int, ready_timeout_s: float, stop_timeout_s: float, root: Path = ROOT):
        """`root`: the checkout whose `splitserve` runs (another version's, to compare with it)."""
        self.topology = label
        self.root = root
        self.run_dir = run_dir
        self.worker_threads = worker_threads
        self.stop_timeout_s = stop_timeout_s
        self.port = free_port()
        self.namespace = f"bench-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.served_name = served_name
        # The model first: further models (`--model B:...` among `topology_args`) come after it.
        self.cmd = [sys.executable, "-m", "services.cli.main", "up", "--model", model_dir, *topology_args,
                    "--served-model-name", served_name, "--port", str(self.port),
                    "--run-dir", str(run_dir), "--namespace", self.namespace, "--dtype", dtype,
                    "--ready-timeout", f"{ready_timeout_s:g}"]
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._lines_q: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None
        self.base_url: str | None = None
        self.processes: list[dict[str, Any]] = []  # every pid of the deployment seen by `ps`

    def start(self) -> None:
        env = dict(os.environ)
        threads = str(self.worker_threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(self.root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        launch = LAUNCH if self.root == ROOT else popen_launch  # (another checkout's code runs in its own interpreter)
        self.proc = launch(self.cmd, env, self.root)
        self._reader = threading.Thread(target=self._read, name=f"up-{self.topology}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            self._lines_q.put(line)
            print(f"  [up {self.topology}] {line}", flush=True)
        self._lines_q.put(None)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the 'splitserve ready' line; raises on exit or deadline."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no 'splitserve ready' line within {timeout_s:g} s")
            try:
                line = self._lines_q.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait(timeout=5) if self.proc else None
                tail = "\n".join(self.lines[-15:])
                raise RuntimeError(f"`splitserve up` exited with {code} before it was ready:\n{tail}")
            match = re.search(r"splitserve ready: (\S+)", line)
            if match:
                self.base_url = match.group(1)
                return time.monotonic() - started

    def ps(self) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "ps", "--run-dir", str(self.run_dir), "--json"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"splitserve ps failed ({out.returncode}): {out.stderr.strip()[:500]}")
        data = json.loads(out.stdout)
        known = {(p["pid"], p.get("start_time")) for p in self.processes}
        entries = [dict(name=s["name"], role=s["role"], pid=s.get("pid"), start_time=s.get("start_time"))
                   for s in data.get("services", [])]
        nats = data.get("nats") or {}
        if nats.get("embedded") and nats.get("pid"):
            entries.append(dict(name="nats", role="nats", pid=nats["pid"], start_time=nats.get("start_time")))
        for e in entries:
            if e["pid"] and (e["pid"], e["start_time"]) not in known:
                self.processes.append(e)
        return data

    def pin_workers(self, roles: tuple[str, ...], cores: list[int]) -> dict[str, int]:
        """Pin each service of `roles` to one of `cores`, round-robin in name order; {name: core}."""
        services = [s for s in self.ps().get("services", []) if s["role"] in roles]
        pinned = {}
        for i, service in enumerate(sorted(services, key=lambda s: s["name"])):
            pinned[service["name"]] = cores[i % len(cores)]
            pin_process(service["pid"], pinned[service["name"]])
        return pinned

    def stop(self) -> dict[str, Any]:
        """SIGTERM the launcher and wait; past the deadline kill its group and every service it started."""
        result: dict[str, Any] = {"clean": True, "exit_code": None, "seconds": 0.0, "killed": []}
        if self.proc is None:
            return result
        started = time.monotonic()
        if self.proc.poll() is None:
            # Learn every pid first (a restarted worker has a new one), in case the launcher has to be killed.
            with contextlib.suppress(Exception):
                if (self.run_dir / "deployment.json").exists():
                    self.ps()
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                result["clean"] = False
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                result["killed"].append(f"launcher (pgid {self.proc.pid})")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
        result["exit_code"] = self.proc.poll()
        # Services run in their own sessions: make sure none of them outlives the launcher.
        from services.launcher.procs import pid_alive

        grace = time.monotonic() + (5.0 if result["clean"] else 0.0)
        for entry in self.processes:
            pid, start_time = entry["pid"], entry["start_time"]
            while pid_alive(pid, start_time) and time.monotonic() < grace:
                time.sleep(0.1)
            if pid_alive(pid, start_time):
                result["clean"] = False
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                result["killed"].append(f"{entry['name']} (pid {pid})")
        # Killed processes take a moment to go (and be reaped once orphaned).
        deadline = time.monotonic() + 10.0
        left = [e for e in self.processes if pid_alive(e["pid"], e["start_time"])]
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [e for e in left if pid_alive(e["pid"], e["start_time"])]
        result["still_running"] = [f"{e['name']} (pid {e['pid']})" for e in left]
        if self._reader is not None:
            self._reader.join(timeout=5)
        result["seconds"] = time.monotonic() - started
        return result


def pin_process(pid: int, core: int) -> list[int]:
    """Pin every thread of `pid` to `core` (repeat while new threads appear); the thread ids pinned."""
    pinned: set[int] = set()
    for _ in range(5):
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        except FileNotFoundError:
            raise RuntimeError(f"worker pid {pid} is gone") from None
        new = tids - pinned
        if not new:
            break
        for tid in new:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, {core})
            pinned.add(tid)
    return sorted(pinned)


def fetch_metrics(base_url: str, prefix: str) -> dict[str, float]:
    """The gateway's /metrics samples whose name starts with `prefix`: {'name{labels}': value}."""
    import httpx

    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return samples


def write_deployment_results(args, model_dir: str, config: dict, runs: list[dict], table: str) -> None:
    """Print a deployment benchmark's table and write its results (machine, model, settings, runs) to
    `args.output`, if given."""
    import platform

    print("\n" + table)
    results = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "cores": args.cores},
        "model": {"dir": model_dir, "num_hidden_layers": config["num_hidden_layers"],
                  "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"]},
        "settings": {k: v for k, v in vars(args).items() if k != "output"} | {"command": " ".join(sys.argv)},
        "runs": runs,
        "table": table,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.output}")


@contextlib.contextmanager
def serving(label: str, up_args: list[str], *, model_dir: str, run_dir: Path, dtype: str, root: Path = ROOT):
    """A ready `splitserve up` deployment (served as "bench", its workers on one thread each; of the checkout at
    `root`) for the block; it says what it runs and is stopped however the block ends."""
    deployment = UpProcess(label, up_args, model_dir=model_dir, served_name="bench", run_dir=run_dir, dtype=dtype,
                           worker_threads=1, ready_timeout_s=600, stop_timeout_s=30, root=root)
    print(f"\n== {label}: splitserve up {' '.join(deployment.cmd[4:])}", flush=True)
    try:
        deployment.start()
        deployment.wait_ready(600)
        yield deployment
    finally:
        print(f"   stopped: {deployment.stop()}", flush=True)
