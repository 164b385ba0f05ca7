"""The preloaded spawner: a `python -m` command forked off one forkserver runs as it would on its own (arguments,
environment, directory, session, output, exit code, its command line in /proc), dies with the process that started
the forkserver, and a command the forkserver's imports do not fit executes itself instead."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from services.launcher.forkserver_fork import TITLE
from services.launcher.service_spawner import ServiceSpawner, import_time_changes, service_module
from launcher_helpers import proc_alive
from support.processes import ROOT, parent_of, service_env

PROBE = [sys.executable, "-m", "support.spawn_probe"]


def test_only_the_same_interpreters_service_modules_fork():
    assert service_module([sys.executable, "-m", "services.decode", "--x", "1"]) == ("services.decode", ["--x", "1"])
    assert service_module(["/usr/bin/env", "-m", "services.decode"]) is None  # another program
    assert service_module([sys.executable, "-m", "json.tool"]) is None  # not a service
    assert service_module([sys.executable, "services/decode/__main__.py"]) is None
    assert service_module([sys.executable, "-m"]) is None


@pytest.mark.parametrize("server, child, changed", [
    ({"PATH": "/bin"}, {"PATH": "/usr/bin", "SPLITSERVE_X": "1"}, []),  # read later, from the fork's environment
    ({"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "1"}, ["OMP_NUM_THREADS"]),
    ({}, {"LD_PRELOAD": "libtcmalloc.so"}, ["LD_PRELOAD"]),
    ({"HF_HUB_OFFLINE": "1"}, {}, ["HF_HUB_OFFLINE"]),
    ({"PYTHONPATH": "/a"}, {"PYTHONPATH": "/b", "PYTHONUNBUFFERED": "1"}, []),  # applied by the fork itself
    ({}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}, []),  # what torch sets as it imports
])
def test_import_time_variables_that_differ(server, child, changed):
    assert import_time_changes(server, child) == changed


@pytest.fixture
def spawner():
    return ServiceSpawner(packages=("support.",))


def _spawn(spawner, tmp_path, argv, **env):
    out = tmp_path / "out.log"
    with open(out, "ab") as log:
        proc = spawner.spawn(argv, env=service_env(**env), cwd=str(tmp_path), output_fd=log.fileno())
    assert proc is not None
    return proc, out


def test_a_forked_command_runs_as_python_m_would(spawner, tmp_path):
    proc, out = _spawn(spawner, tmp_path, [*PROBE, "report", "3"], SPAWN_PROBE_VALUE="given")
    assert proc.wait(timeout=60) == 3 and proc.returncode == 3
    report, stderr = out.read_text().splitlines()[:2]
    report = json.loads(report)
    assert report["argv"][1:] == ["report", "3"] and report["argv"][0].endswith("spawn_probe.py")
    assert report["name"] == "__main__" and report["cwd"] == str(tmp_path)
    assert report["preloaded"]  # a fork of the forkserver, which imported torch
    assert report["env"] == service_env(SPAWN_PROBE_VALUE="given")  # exactly what it was given
    assert report["pid"] == report["pgid"] == report["sid"] == proc.pid  # its own session and group
    assert stderr == "to stderr"


def test_a_forked_command_shows_its_command_line_and_takes_signals(spawner, tmp_path):
    proc, out = _spawn(spawner, tmp_path, [*PROBE, "sleep"])
    deadline = time.monotonic() + 60
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(out.read_text()) == proc.pid
    cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    assert cmdline.startswith(" ".join([*PROBE, "sleep"]))  # what `ps` shows
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_a_command_the_preloaded_imports_do_not_fit_executes_itself(spawner, tmp_path):
    # (a fresh interpreter finds modules by PYTHONPATH alone)
    proc, out = _spawn(spawner, tmp_path, [*PROBE, "report", "0"], OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"))
    assert proc.wait(timeout=60) == 0, out.read_text()
    report = json.loads(out.read_text().splitlines()[0])
    assert report["env"]["OMP_NUM_THREADS"] == "1" and report["pid"] == report["pgid"] == proc.pid
    assert not report["preloaded"]


@pytest.mark.parametrize("forked_server", [False, True], ids=["started", "forked"])
def test_forked_services_die_with_the_process_that_started_the_forkserver(tmp_path, forked_server):
    """A launcher killed outright leaves no forked service running: the forkserver ends with it, and each fork asked
    for a signal when the forkserver ends. So too where the launcher holds the preload and forks its forkserver (a
    child of the launcher, under a title of its own, not a new interpreter)."""
    preload = "('multiprocessing', 'services.launcher.service_spawner')" if forked_server else "PRELOAD"
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import signal, sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from services.launcher.service_spawner import PRELOAD, ServiceSpawner
        spawner = ServiceSpawner({preload}, packages=("support.",), fork_if_preloaded=True)
        spawner.start()
        with open({str(tmp_path / 'out.log')!r}, "ab") as log:
            procs = [spawner.spawn({PROBE + ['sleep']!r}, output_fd=log.fileno(), death_signal=signal.SIGTERM)
                     for _ in range(2)]
        print(*[p.pid for p in procs], flush=True)
        signal.pause()
        """)], stdout=subprocess.PIPE, text=True, env=service_env(), start_new_session=True)
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 2 and all(proc_alive(pid) for pid in pids)
        (server,) = {parent_of(pid) for pid in pids}
        assert parent_of(server) == launcher.pid
        title = open(f"/proc/{server}/cmdline", "rb").read()
        assert (TITLE.encode() in title) == forked_server and (b"multiprocessing.forkserver" in title) != forked_server
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(proc_alive(pid) for pid in [*pids, server]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(proc_alive(pid) for pid in [*pids, server])
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
