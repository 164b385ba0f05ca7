"""An idle prefill worker's CPUs lent to a decode worker: who runs where, and when the CPUs go back.

The lender and the borrower are real flock holders on a real loan file. The borrower's side runs in a fresh
interpreter with an engine thread of its own: torch's thread counts and CPU affinity are process-wide state.
"""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from services.common.cpu_loan import CpuBorrower, CpuLender
from support.waiting import wait_until

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a loan needs two CPUs")

BORROWER_PROBE = textwrap.dedent("""
    import json, os, sys, threading, torch
    from pathlib import Path
    from services.common.cpu_loan import CpuBorrower
    from services.common.cpus import pin_threads
    from services.common.engine_thread import EngineThread

    own, lent = (int(sys.argv[2]),), (int(sys.argv[3]),)
    os.sched_setaffinity(0, own)  # as a decode worker's --cpus binds it (after importing torch, as it does)
    torch.set_num_threads(1)
    before = set(os.listdir("/proc/self/task"))  # the main thread, and one `import torch` starts idle
    engine = EngineThread()
    borrower = CpuBorrower(Path(sys.argv[1]), own=own, lent=lent)

    def allowed_on_lent_cpu() -> int:  # how many of the threads started since may run on the lent CPU
        count = 0
        for task in set(os.listdir("/proc/self/task")) - before:
            if lent[0] in os.sched_getaffinity(int(task)):
                count += 1
        return count

    def state():
        return {"threads": torch.get_num_threads(), "engine_cpus": sorted(os.sched_getaffinity(0)),
                "lent": borrower.counts.lent, "returned": borrower.counts.returned,
                "on_lent_cpu": allowed_on_lent_cpu()}

    engine.submit(borrower.start).result()
    print(json.dumps(engine.submit(state).result()), flush=True)
    def move(lent_now):  # as a new placement moves it (`services.common.cpu_follow`): every thread, then the loan
        pin_threads(own)
        borrower.move(own, lent_now)

    for line in sys.stdin:  # one command a line: step | idle | move [LENT]
        command = line.split()
        if command[0] == "move":
            engine.submit(move, tuple(int(cpu) for cpu in command[1:])).result()
        else:
            engine.submit(borrower.before_step if command[0] == "step" else borrower.idle).result()
        print(json.dumps(engine.submit(state).result()), flush=True)
""")


class Borrower:
    """The probe above, driven a line at a time."""

    def __init__(self, loan, own: int, lent: int):
        self.proc = subprocess.Popen([sys.executable, "-c", BORROWER_PROBE, str(loan), str(own), str(lent)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started = self._read()

    def _read(self) -> dict:
        import json

        line = self.proc.stdout.readline()
        assert line, "the borrower probe died"
        return json.loads(line)

    def do(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def cpus():
    own, lent = sorted(os.sched_getaffinity(0))[:2]
    return own, lent


@needs_two_cpus
def test_the_decode_worker_runs_on_lent_cpus_only_while_the_prefill_worker_is_idle(tmp_path, cpus):
    own, lent = cpus
    loan = tmp_path / "loans" / "prefill-0.loan"
    lender = CpuLender(loan, deadline_s=30)  # starting: demand on; a deadline no loaded machine reaches
    assert oct(loan.stat().st_mode & 0o777) == "0o600" and oct(loan.parent.stat().st_mode & 0o777) == "0o700"
    borrower = Borrower(loan, own, lent)
    try:
        # Its engine thread stays on its own CPU; a step of its own runs one thread there; only its OpenMP team's
        # other thread may run on the lent CPU (not the engine thread, the event loop or any other thread).
        assert borrower.started == {"threads": 1, "engine_cpus": [own], "lent": 0, "returned": 0, "on_lent_cpu": 1}
        assert borrower.do("step")["threads"] == 1  # the lender is loading: nothing lent

        lender.idle()
        assert borrower.do("step") == {"threads": 2, "engine_cpus": [own], "lent": 1, "returned": 0, "on_lent_cpu": 1}

        # The lender wants its CPU back: its claim waits until the borrower's next step boundary.
        claimed = threading.Event()
        claim = threading.Thread(target=lambda: (lender.before_step(), claimed.set()))
        claim.start()
        wait_until(lambda: lender.counts.claims == 1, 10, "the lender never asked for its CPU back", poll_s=0.01)
        assert not claimed.wait(0.2)  # (that it waits is the claim: not done within 0.2 s)
        assert borrower.do("step") == {"threads": 1, "engine_cpus": [own], "lent": 1, "returned": 1, "on_lent_cpu": 1}
        claim.join(5)
        assert claimed.is_set() and lender.counts.claims == 1 and lender.counts.overdue == 0
        assert lender.counts.claim_wait_s >= 0.1  # it counted its wait

        assert borrower.do("step")["threads"] == 1  # not while the lender computes
        lender.idle()
        assert borrower.do("step")["threads"] == 2
        assert borrower.do("idle")["threads"] == 1  # an idle borrower holds nothing
        waited = lender.counts.claim_wait_s
        lender.before_step()
        # Nothing to wait for: a lock the idle borrower still held would come back only at its 30 s deadline (the
        # borrower steps no more), so the bound is loose.
        assert lender.counts.claim_wait_s - waited < 5 and lender.counts.claims == 2 and lender.counts.overdue == 0
    finally:
        borrower.close()
        lender.close()


@needs_two_cpus
def test_a_lender_whose_worker_still_ships_kv_keeps_its_cpus_until_it_is_quiet(tmp_path, cpus):
    """Its event loop runs on those CPUs while it ships KV or writes blocks back: no borrower thread beside it."""
    own, lent = cpus
    loan = tmp_path / "loans" / "prefill-0.loan"
    lender = CpuLender(loan, deadline_s=30)
    shipping = [True]
    lender.quiet = lambda: not shipping[0]
    borrower = Borrower(loan, own, lent)
    try:
        lender.idle()  # the engine is idle, the worker is not
        assert borrower.do("step")["threads"] == 1
        shipping[0] = False
        lender.idle()  # the engine loop says idle again within its idle wait
        assert borrower.do("step")["threads"] == 2
    finally:
        borrower.close()
        lender.close()


@contextlib.contextmanager
def lending(tmp_path, cpus, deadline_s: float):
    """A lender and its borrower, the CPU lent and borrowed once."""
    loan = tmp_path / "prefill-0.loan"
    lender = CpuLender(loan, deadline_s=deadline_s)
    borrower = Borrower(loan, *cpus)
    try:
        lender.idle()
        assert borrower.do("step")["threads"] == 2
        yield lender, borrower
    finally:
        borrower.close()
        lender.close()


@needs_two_cpus
def test_a_borrower_that_does_not_step_is_overdue_and_the_lender_computes_anyway(tmp_path, cpus):
    with lending(tmp_path, cpus, deadline_s=0.2) as (lender, borrower):
        started = time.monotonic()
        lender.before_step()  # the borrower is in a long step: past the deadline the lender goes ahead
        # The time is the claim: it waits out its 0.2 s deadline, then goes ahead (not the borrower's next step,
        # which never comes here); the upper bound is loose for a loaded machine.
        assert 0.2 <= time.monotonic() - started < 5
        assert lender.counts.overdue == 1
        assert borrower.do("step")["threads"] == 1  # gives back at its next boundary
        lender.before_step()  # and now the lender holds the lock
        assert lender._locked
        assert borrower.do("step")["threads"] == 1


@needs_two_cpus
def test_the_loan_follows_the_lenders_cpus(tmp_path, cpus):
    """The lender's CPUs change (`services.launcher.cpu_handover`): the borrower gives back what it holds, runs on
    nothing lent while the two are not one CPU each, and borrows the lender's CPU again once they are."""
    own, lent = cpus
    with lending(tmp_path, cpus, deadline_s=30) as (_, borrower):
        assert borrower.do("move") == {"threads": 1, "engine_cpus": [own], "lent": 1, "returned": 0, "on_lent_cpu": 0}
        assert borrower.do("step")["threads"] == 1  # the lender idles, but lends nothing this borrower may take
        assert borrower.do(f"move {lent}")["on_lent_cpu"] == 1  # the team's other thread, again
        assert borrower.do("step") == {"threads": 2, "engine_cpus": [own], "lent": 2, "returned": 0, "on_lent_cpu": 1}


LENDER_PROBE = textwrap.dedent("""
    import sys, time
    from services.common.cpu_loan import CpuLender

    lender = CpuLender(sys.argv[1])
    lender.idle()
    lender.before_step()  # computing
    print("claimed", flush=True)
    time.sleep(600)
""")


@needs_two_cpus
def test_a_killed_prefill_worker_never_keeps_its_cpus_and_its_restart_still_excludes_the_borrower(tmp_path, cpus):
    own, lent = cpus
    loan = tmp_path / "prefill-0.loan"
    proc = subprocess.Popen([sys.executable, "-c", LENDER_PROBE, str(loan)], stdout=subprocess.PIPE, text=True)
    borrower = Borrower(loan, own, lent)
    try:
        assert proc.stdout.readline().strip() == "claimed"
        assert borrower.do("step")["threads"] == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # Killed mid-job: its demand byte still says "busy", so the borrower waits for the restarted worker.
        assert borrower.do("step")["threads"] == 1
        restarted = CpuLender(loan, deadline_s=30)  # the same file, opened in place: the borrower's open copy still counts
        restarted.idle()
        assert borrower.do("step")["threads"] == 2
        claim = threading.Thread(target=restarted.before_step)
        claim.start()
        wait_until(lambda: restarted.counts.claims == 1, 10, "the restarted lender never asked for its CPU back",
                   poll_s=0.01)
        claim.join(0.2)
        assert claim.is_alive()  # the borrower's lock, taken through the file it opened before the restart
        assert borrower.do("step")["threads"] == 1
        claim.join(5)
        assert not claim.is_alive() and restarted.counts.overdue == 0
    finally:
        borrower.close()
        proc.kill()


def test_without_a_loan_file_nothing_is_borrowed(tmp_path):
    borrower = CpuBorrower(tmp_path / "absent.loan", own=(0,), lent=(1,))
    borrower.before_step()
    assert borrower.counts.lent == 0


def test_a_stopping_engine_loop_hands_its_cpus_back_and_closes_the_loan(tmp_path, default_model):
    """A prefill worker stopped in the middle of a prompt must not leave its claim (demand byte and lock) behind."""
    import fcntl

    from services.common.engine_loop import AddRequest, EngineLoop
    from services.common.engine_thread import EngineThread
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    loan = tmp_path / "loans" / "prefill-0.loan"
    lender = CpuLender(loan, deadline_s=0.01)
    thread = EngineThread()
    engine = thread.submit(LLMEngine, EngineConfig(model=default_model, max_num_seqs=2)).result(120)
    loop = EngineLoop(engine, lambda outputs: None, thread, cpu_share=lender)
    loop.start()
    loop.add(AddRequest("r", list(range(5, 40)), SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)))
    wait_until(lambda: lender.counts.claims >= 1, 60, "the engine loop never claimed its CPUs for the request's steps",
               poll_s=0.01)
    loop.stop()
    assert loop.crashed is None
    assert loan.read_bytes()[:1] == b"\x00"  # lent again
    other = os.open(loan, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its lock is gone: a borrower may take the CPUs
    finally:
        os.close(other)
    lender.close()  # closing twice is harmless
