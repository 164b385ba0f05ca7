"""A real service process: SIGTERM exits 0 and leaves the registry; a crashed actor exits 70."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from contracts import CancelRequest
from shared.bus.registry import Registry

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

TINY_SERVICE = Path(__file__).with_name("tiny_service.py")


def start_tiny_service(url: str, bucket: str, subject: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(TINY_SERVICE), url, bucket, subject],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "ready", or "" if it died first
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"tiny service did not start: {line!r} {proc.stderr.read()}")
    return proc


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, list[dict]]:
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, [json.loads(line) for line in stderr.splitlines() if line.strip()]


async def test_sigterm_drains_and_exits_0(nc, js, nats_url, unique):
    bucket, subject = unique("reg"), unique("cancel")
    registry = await Registry.open(js, bucket, ttl_s=2.0)
    proc = await asyncio.to_thread(start_tiny_service, nats_url, bucket, subject)
    assert (await registry.get("test", "tiny-1")).state == "ready"

    await nc.publish(subject, CancelRequest(request_id="req-7").encode())
    await nc.flush()
    assert await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 10) == "handled req-7\n"
    proc.send_signal(signal.SIGTERM)
    code, lines = await asyncio.to_thread(finish, proc, 5)

    assert code == 0
    assert await registry.get("test", "tiny-1") is None  # removed on the way out, not left to expire
    assert lines and all(line["service"] == "tiny" and line["instance"] == "tiny-1" for line in lines), lines
    events = {line["event"]: line for line in lines}
    assert events["handling cancel"]["request_id"] == "req-7"
    assert events["shutdown requested"]["signal"] == "SIGTERM"
    assert events["exiting"]["code"] == 0
    assert "request_id" not in events["exiting"]


async def test_a_crashed_task_exits_70(nc, nats_url, unique):
    bucket, subject = unique("reg"), unique("cancel")
    proc = await asyncio.to_thread(start_tiny_service, nats_url, bucket, subject)
    await nc.publish(subject, CancelRequest(request_id="crash").encode())
    await nc.flush()
    code, lines = await asyncio.to_thread(finish, proc, 5)

    assert code == 70
    crash = next(line for line in lines if line["event"] == "task failed; stopping the service")
    assert crash["task"] == "canceller" and crash["level"] == "error"
    assert "told to crash" in crash["exception"]
