"""Shared by the launcher tests: process checks, free ports, fake services."""

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from support.processes import free_port  # noqa: F401  (re-exported for the launcher tests)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FAKE_SERVICE = HERE / "fake_service.py"
FAKE_UP = HERE / "fake_up.py"


def proc_alive(pid: int) -> bool:
    """Checked straight in /proc, independently of the code under test; zombies count as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def cli(*args: str, timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
    """`splitserve ARGS...` as a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


def make_fake_python(directory: Path) -> str:
    """An executable that takes `-m services.ROLE FLAGS...` like python, and runs a fake service."""
    path = directory / "fakepython"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVICE}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def make_fake_model(directory: Path) -> str:
    model = directory / "fake-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return str(model)


def start_fake_up(run_dir: Path, port: int, fake_python: str, model: str, *, decode: int = 1,
                  ready_timeout_s: float = 20.0, env: dict | None = None) -> subprocess.Popen:
    """A launcher (the real one) whose services are fakes, in its own process."""
    return subprocess.Popen(
        [sys.executable, str(FAKE_UP), str(run_dir), str(port), fake_python, model, str(decode), str(ready_timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, **(env or {})),
    )


def read_line(stream, timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else ""


def read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "deployment.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def up_and_run(**given):
    """(UpSettings, ResolvedRun) for `topology.plan`: each given value goes to whichever has the field; the run's
    facts default to a model /models/m served as m on nats://127.0.0.1:4999, CPUs and drain left to the OS and
    the services."""
    import dataclasses

    from services.launcher.resolved_run import ResolvedRun
    from services.launcher.up_settings import UpSettings

    facts = {f.name for f in dataclasses.fields(ResolvedRun)}
    run = {"model_dir": "/models/m", "served_model_name": "m", "nats_url": "nats://127.0.0.1:4999", "cpus": (),
           "drain_timeout": None}
    run |= {name: value for name, value in given.items() if name in facts}
    return UpSettings(**{name: value for name, value in given.items() if name not in facts}), ResolvedRun(**run)


def planned(**given):
    """`topology.plan` of `up_and_run(**given)`."""
    from services.launcher.topology import plan

    return plan(*up_and_run(**given))
