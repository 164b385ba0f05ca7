"""A sender in another process: both backends across a process boundary, and a sender killed mid-transfer."""

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from shared.transfer import sweep_orphan_segments
from support.waiting import eventually
from transfer_helpers import Sink, kv, segments_of_pid

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

SCRIPT = Path(__file__).with_name("sender_process.py")


async def start_sender(ticket, **spec) -> asyncio.subprocess.Process:
    data = msgspec.to_builtins(ticket)
    return await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), json.dumps({"ticket": data, **spec}),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )


async def result_of(proc: asyncio.subprocess.Process) -> dict:
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    lines = [line for line in out.decode().splitlines() if line.startswith("RESULT ")]
    assert lines, f"the sender process printed no result (exit {proc.returncode}): {out.decode()[-2000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize("backend, close", [("tcp", True), ("shm", True), ("shm", False)])
async def test_a_sender_in_another_process_delivers_exact_bytes(receiver, backend, close):
    src = kv(5, torch.bfloat16, seed=11)
    sink = Sink(src)
    ticket = receiver.expect("xproc", on_part=sink, total_layers=(0, 5), deadline_s=30)
    proc = await start_sender(ticket, backend=backend, layers=5, seed=11, dtype="bfloat16", mode="all", close=close)
    got = await receiver.wait("xproc")
    sent = await result_of(proc)
    assert got.ok and sent["ok"], (got, sent)
    assert got.backend == sent["backend"] == backend
    assert torch.equal(sink.dst, src)
    assert proc.returncode == 0
    assert segments_of_pid(proc.pid) == []  # its pool was closed on the way out (by `close()` or at exit)


async def test_a_killed_sender_fails_the_transfer_at_once_and_its_segments_are_swept(receiver):
    src = kv(3, seed=12)
    sink = Sink(src)
    ticket = receiver.expect("killed", on_part=sink, total_layers=(0, 3), deadline_s=30)
    proc = await start_sender(ticket, backend="shm", layers=3, seed=12, dtype="float32", mode="hang")
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.strip() == b"SENT-FIRST"
    await eventually(lambda: sink.calls, what="the first layer applied")
    assert sink.calls == [(0, 1)]
    leftovers = segments_of_pid(proc.pid)
    assert leftovers, "the sender's pooled segment should exist while it lives"

    os.kill(proc.pid, signal.SIGKILL)  # a prefill worker dies mid-job
    await proc.wait()
    start = asyncio.get_running_loop().time()
    got = await receiver.wait("killed")
    assert not got.ok and got.reason == "connection", got
    # The time is the claim: noticed when the connection dropped, not at the 30 s deadline (loose for a loaded machine).
    assert asyncio.get_running_loop().time() - start < 10

    assert segments_of_pid(proc.pid) == leftovers  # a killed process cannot clean up...
    assert sweep_orphan_segments() >= len(leftovers)  # ...so the next sender or receiver start does
    assert segments_of_pid(proc.pid) == []
