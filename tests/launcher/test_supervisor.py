"""Supervisor with real child processes: restarts, give-up, clean stop."""

import signal
import subprocess
import sys
import time

import pytest
from launcher_helpers import ROOT, proc_alive, wait_until

from services.launcher.supervisor import ChildState, RestartPolicy, Supervisor, SupervisorError

PY = sys.executable
SLEEPER = [PY, "-c", "import time; time.sleep(60)"]
FAST = RestartPolicy(base_delay_s=0.05, max_delay_s=0.2, max_restarts=5, window_s=60)


def test_a_crashed_child_is_restarted_and_what_it_left_behind_is_killed(tmp_path):
    marker = tmp_path / "crashed-once"
    grandchild_pid = tmp_path / "grandchild.pid"
    # First run: start a grandchild in the same process group, then crash.
    # Second run: stay up.
    code = (
        "import pathlib, subprocess, sys, time\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "if not marker.exists():\n"
        "    marker.write_text('x')\n"
        f"    p = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(60)'])\n"
        f"    pathlib.Path({str(grandchild_pid)!r}).write_text(str(p.pid))\n"
        "    print('crashing', flush=True)\n"
        "    sys.exit(3)\n"
        "print('second run', flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path / "logs", FAST)
    try:
        child = sup.add("flaky", [PY, "-c", code], role="decode", instance_id="decode-0")
        sup.start()
        first_pid = child.pid
        events = []
        assert wait_until(lambda: events.extend(sup.poll()) or child.restarts == 1 and child.running, 10)
        assert child.pid != first_pid and child.state == ChildState.RUNNING
        assert [e.kind for e in events][:2] == ["exited", "restarted"]
        assert events[0].exit_code == 3 and "exited with code 3" in events[0].message
        assert wait_until(lambda: not proc_alive(int(grandchild_pid.read_text())), 5)
        assert wait_until(lambda: "second run" in child.log_path.read_text(), 5)
        log = child.log_path.read_text()
        assert "crashing" in log and "restarting in" in log and "restart 1 of flaky" in log
    finally:
        sup.stop(2)
    assert not proc_alive(child.pid)


def test_a_child_that_keeps_crashing_is_marked_failed(tmp_path):
    sup = Supervisor(tmp_path / "logs", RestartPolicy(base_delay_s=0.01, max_delay_s=0.02, max_restarts=2, window_s=60,
                                                      failed_retry_s=None))
    try:
        child = sup.add("broken", [PY, "-c", "import sys; sys.exit(1)"])
        sup.add("fine", SLEEPER)
        sup.start()
        events = []
        assert wait_until(lambda: events.extend(sup.poll()) or child.state == ChildState.FAILED, 10)
        assert child.restarts == 2
        gave_up = [e for e in events if e.kind == "gave_up"]
        assert len(gave_up) == 1 and gave_up[0].name == "broken" and "marked failed" in gave_up[0].message
        assert [c.name for c in sup.failed()] == ["broken"]
        assert sup.child("fine").running  # the others are not affected
        sup.run_for(0.2)
        assert child.restarts == 2  # no more attempts
    finally:
        sup.stop(2)


def test_a_failed_child_is_tried_again_after_its_backoff_and_fails_again_at_once(tmp_path):
    policy = RestartPolicy(base_delay_s=0.01, max_delay_s=0.02, max_restarts=2, window_s=60, failed_retry_s=0.5)
    sup = Supervisor(tmp_path / "logs", policy)
    try:
        child = sup.add("broken", [PY, "-c", "import sys; sys.exit(1)"])
        sup.start()
        events = []
        assert wait_until(lambda: events.extend(sup.poll()) or child.state == ChildState.FAILED, 10)
        assert child.restarts == 2
        sup.run_for(0.2)
        assert child.restarts == 2 and child.state == ChildState.FAILED  # not before its backoff
        # Tried again once; dying at once it is failed again, without a new round of quick restarts.
        assert wait_until(lambda: events.extend(sup.poll()) or child.restarts == 3, 10)
        assert wait_until(lambda: events.extend(sup.poll()) or child.state == ChildState.FAILED, 10)
        sup.run_for(0.2)
        assert child.restarts == 3 and [e.kind for e in events].count("gave_up") == 2
    finally:
        sup.stop(2)


def test_stop_leaves_no_process_even_a_child_ignoring_sigterm_or_a_grandchild(tmp_path):
    grandchild_pid = tmp_path / "grandchild.pid"
    stubborn_code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ignoring SIGTERM', flush=True)\n"
        "time.sleep(60)\n"
    )
    parent_code = (
        "import pathlib, subprocess, time\n"
        f"p = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(grandchild_pid)!r}).write_text(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor(tmp_path / "logs", FAST)
    sleeper = sup.add("sleeper", SLEEPER)
    stubborn = sup.add("stubborn", [PY, "-c", stubborn_code])
    parent = sup.add("parent", [PY, "-c", parent_code])
    sup.start()
    assert wait_until(lambda: "ignoring SIGTERM" in stubborn.log_path.read_text() and grandchild_pid.exists(), 10)
    grandchild = int(grandchild_pid.read_text())
    pids = [sleeper.pid, stubborn.pid, parent.pid, grandchild]
    assert all(proc_alive(pid) for pid in pids)

    started = time.monotonic()
    codes = sup.stop(timeout_s=1.5)
    elapsed = time.monotonic() - started

    # The time is the claim: the child ignoring SIGTERM is killed at the 1.5 s stop timeout, not waited for (its 60 s
    # sleep); the bound is loose for a loaded machine.
    assert elapsed < 15
    assert not [pid for pid in pids if proc_alive(pid)]
    assert codes["sleeper"] == -signal.SIGTERM
    assert codes["stubborn"] == -signal.SIGKILL and stubborn.killed and not sleeper.killed
    assert all(c.state == ChildState.STOPPED for c in sup.children)
    assert "SIGKILL" in stubborn.log_path.read_text()
    # Nothing is restarted after a stop.
    assert sup.poll() == [] and not any(proc_alive(pid) for pid in pids)
    with pytest.raises(SupervisorError):
        sup.start()


def test_children_die_with_the_supervising_process(tmp_path):
    """A launcher killed with SIGKILL cannot stop its children: they get SIGTERM from the kernel."""
    code = (
        "import sys, time\n"
        "from services.launcher.supervisor import Supervisor\n"
        f"sup = Supervisor({str(tmp_path / 'logs')!r})\n"
        f"c = sup.add('sleeper', [{PY!r}, '-c', 'import time; time.sleep(60)'])\n"
        "sup.start()\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        child_pid = int(owner.stdout.readline())
        assert proc_alive(child_pid)
    finally:
        owner.kill()
        owner.wait()
    assert wait_until(lambda: not proc_alive(child_pid), 5)


def test_children_get_the_extra_environment_and_their_own_log(tmp_path):
    sup = Supervisor(tmp_path / "logs", FAST)
    child = sup.add("env", [PY, "-c", "import os; print('VALUE=' + os.environ['SPLITSERVE_TEST_VALUE'])"],
                    env={"SPLITSERVE_TEST_VALUE": "42"})
    sup.start()
    assert wait_until(lambda: "VALUE=42" in child.log_path.read_text(), 5)
    assert child.log_path == tmp_path / "logs" / "env.log"
    sup.stop(1)


def test_a_chatty_childs_log_rotates_within_its_bound_and_keeps_the_newest_lines(tmp_path):
    sup = Supervisor(tmp_path / "logs", FAST, log_max_bytes=20_000, log_backups=2)
    child = sup.add("chatty", [PY, "-c", "import sys\nfor i in range(10000): print(f'line {i:05d}', flush=i % 100 == 0)\n"
                                         "print('last words', file=sys.stderr)"])
    sup.start()
    assert wait_until(lambda: sup.poll() or not child.running, 10)
    sup.stop(1)
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name for p in logs] == ["chatty.log", "chatty.log.1", "chatty.log.2"]  # older ones are gone
    assert all(p.stat().st_size <= 20_000 for p in logs)
    assert all(p.stat().st_mode & 0o077 == 0 for p in logs)  # the launcher's user alone reads them
    kept = (tmp_path / "logs" / "chatty.log.2").read_text() + (tmp_path / "logs" / "chatty.log.1").read_text() + \
        child.log_path.read_text()
    numbers = [int(line.split()[1]) for line in kept.splitlines() if line.startswith("line ")]
    assert numbers == list(range(numbers[0], 10000)) and numbers[0] > 0  # the newest, in order, none missing
    assert "last words" in child.log_path.read_text()  # stderr too, up to the very end


def test_bad_children_are_refused(tmp_path):
    sup = Supervisor(tmp_path / "logs")
    sup.add("a", SLEEPER)
    with pytest.raises(SupervisorError, match="already exists"):
        sup.add("a", SLEEPER)
    with pytest.raises(SupervisorError, match="may only contain"):
        sup.add("../escape", SLEEPER)
    with pytest.raises(SupervisorError, match="empty"):
        sup.add("b", [])
    sup.add("missing", [str(tmp_path / "no-such-program")])
    with pytest.raises(SupervisorError, match="cannot start missing"):
        sup.start("missing")
    sup.stop(1)


def test_a_retired_child_gets_sigterm_is_removed_once_gone_and_one_ignoring_it_is_killed(tmp_path):
    stubborn = [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ig' 'noring', flush=True);"
                          " time.sleep(60)"]
    sup = Supervisor(tmp_path / "logs", FAST)
    try:
        polite = sup.add("decode-1", SLEEPER, role="decode")
        deaf = sup.add("decode-2", stubborn, role="decode")
        sup.add("decode-0", SLEEPER, role="decode")
        sup.start()
        assert wait_until(lambda: "ignoring" in deaf.log_path.read_text(), 10)
        sup.retire("decode-1", timeout_s=5)
        sup.retire("decode-2", timeout_s=0.5)
        assert polite.state == ChildState.STOPPING
        events = []
        assert wait_until(lambda: events.extend(sup.poll()) or len(sup.children) == 1, 10)
        assert sorted((e.kind, e.name) for e in events) == [("retired", "decode-1"), ("retired", "decode-2")]
        assert not proc_alive(polite.pid) and not proc_alive(deaf.pid) and deaf.killed and not polite.killed
        assert [c.name for c in sup.children] == ["decode-0"] and sup.children[0].running
        assert "retired" in polite.log_path.read_text()
    finally:
        sup.stop(2)
