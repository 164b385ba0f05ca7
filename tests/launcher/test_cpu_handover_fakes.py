"""A scale hands the running workers' CPUs over (the real launcher, fake workers that answer their placement
files): the new share of `up`'s CPUs, no CPU held by two workers at any moment, each worker's CPUs as acked in
`ps`; a worker that refuses leaves the handover where it stopped and new workers start on free CPUs."""

import json
import os
import stat
import threading

import pytest
from launcher_helpers import cli, free_port, make_fake_model, make_fake_python, read_line, start_fake_up, wait_until

pytestmark = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")


def ps(run_dir) -> dict:
    result = cli("ps", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def cpus_of(run_dir) -> dict:
    return {s["name"]: s.get("cpus") for s in ps(run_dir)["services"] if s["role"] == "decode"}


def start(tmp_path, **env):
    run_dir = tmp_path / "run"
    up = start_fake_up(run_dir, free_port(), make_fake_python(tmp_path), make_fake_model(tmp_path),
                       env={"FAKE_UP_CPUS": "0,1", **env})
    assert read_line(up.stdout, 30).startswith("splitserve ready:"), up.stderr.read() if up.poll() else ""
    return up, run_dir


def said(up, until: str, timeout_s: float = 20) -> list[str]:
    """The launcher's lines from the last call's up to the first saying `until`."""
    if not hasattr(up, "said"):
        up.said, up.read_to = [], 0
        threading.Thread(target=lambda: up.said.extend(iter(up.stderr.readline, "")), daemon=True).start()
    assert wait_until(lambda: any(until in line for line in up.said[up.read_to:]), timeout_s, 0.05), up.said
    end = next(i for i in range(up.read_to, len(up.said)) if until in up.said[i]) + 1
    lines, up.read_to = up.said[up.read_to:end], end
    return lines


def test_a_scale_moves_the_running_worker_before_the_new_one_starts_beside_it(tmp_path):
    up, run_dir = start(tmp_path)
    try:
        placement = run_dir / "cpus" / "decode-0.cpus"
        assert stat.S_IMODE(placement.stat().st_mode) == 0o600
        assert json.loads(placement.read_text()) == {"generation": 0, "cpus": "0,1", "borrow_cpus": ""}
        assert cpus_of(run_dir) == {"decode-0": "0,1"}

        result = cli("scale", "decode=2", "--run-dir", str(run_dir))
        assert result.returncode == 0 and "starting decode-1" in result.stdout, result.stderr
        lines = said(up, "CPU handover done")
        moves = [line.strip().removeprefix("splitserve up: ") for line in lines
                 if line.startswith("splitserve up: CPU handover: decode")]
        assert moves == ["CPU handover: decode-0 on CPUs 0", "CPU handover: decode-1 on CPUs 1"], lines
        assert json.loads((run_dir / "cpus" / "decode-0.cpus.ack").read_text())["cpus"] == "0"
        assert wait_until(lambda: cpus_of(run_dir) == {"decode-0": "0", "decode-1": "1"}, 10, 0.2)
        argv = next(s["argv"] for s in ps(run_dir)["services"] if s["name"] == "decode-1")
        assert argv[argv.index("--cpus") + 1] == "1"

        result = cli("scale", "decode=1", "--run-dir", str(run_dir))
        assert result.returncode == 0 and "retiring decode-1" in result.stdout, result.stderr
        lines = said(up, "CPU handover done")
        assert [line.strip().removeprefix("splitserve up: ") for line in lines
                 if line.startswith("splitserve up: CPU handover: decode")] == [
            "CPU handover: decode-1 stopped", "CPU handover: decode-0 on CPUs 0,1"], lines
        assert wait_until(lambda: cpus_of(run_dir) == {"decode-0": "0,1"}, 10, 0.2)
    finally:
        up.terminate()
        up.wait(30)


def test_a_refused_placement_leaves_the_worker_and_the_new_one_starts_on_free_cpus(tmp_path):
    up, run_dir = start(tmp_path, FAKE_REFUSE_CPUS="1")
    try:
        result = cli("scale", "decode=2", "--run-dir", str(run_dir))
        assert result.returncode == 0 and "starting decode-1" in result.stdout, result.stderr
        lines = said(up, "CPU handover stopped")
        assert ("warning: CPU handover stopped: decode-0 refused CPUs 0 (place): fake refusal; every worker stays "
                "where it last acked (decode-0 on 0,1); decode-1 start on free CPUs") in lines[-1]
        # No CPU is free: the least shared one, as a scale without a handover does.
        assert wait_until(lambda: cpus_of(run_dir) == {"decode-0": "0,1", "decode-1": "0"}, 10, 0.2)
    finally:
        up.terminate()
        up.wait(30)


def test_fewer_cpus_than_workers_hand_nothing_over_and_say_so_once(tmp_path):
    up, run_dir = start(tmp_path, FAKE_UP_CPUS="0")
    try:
        for n in (2, 3):
            result = cli("scale", f"decode={n}", "--run-dir", str(run_dir))
            assert result.returncode == 0, result.stderr
            said(up, f"starting ['decode-{n - 1}']")
        assert wait_until(lambda: cpus_of(run_dir) == {"decode-0": "0", "decode-1": "0", "decode-2": "0"}, 10, 0.2)
        warnings = [line for line in up.said if "no CPU handover" in line]
        assert len(warnings) == 1 and "the new shares overlap" in warnings[0], up.said
    finally:
        up.terminate()
        up.wait(30)
