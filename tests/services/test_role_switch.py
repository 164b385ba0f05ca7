"""`splitserve switch` on a real deployment (`up --role-switch`, disagg, 2 decode + 1 prefill, a tiny random model):
a decode worker switched to prefill mid-stream drains, and every stream ends as an undisturbed greedy run would;
the worker then serves as a prefill worker on the same engine (no reload), refuses what was routed under its old
role epoch, cannot be switched by any key but the admin's, and switches back."""

import asyncio
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import nats
import pytest

from contracts import (HandoffReply, PrefillJob, ServiceStats, StatsRequest, Subjects, TransferEndpoint,
                       TransferTicket)
from shared.engine import SamplingParams
from shared.bus.permissions import inbox_prefix
from support.sse import stream, streamed_text
from support.up import MODEL, ps, start_up
from support.waiting import wait_until
from test_scale import running_on, splitserve

TOKENS = 500


def as_instance(up, name: str, act):
    """`act(nc, subjects)` on a connection holding instance `name`'s key; (its result, the server's refusals)."""
    nats_url = json.loads((up.run_dir / "deployment.json").read_text())["nats"]["url"]
    seed = (up.run_dir / "creds" / f"{name}.nk").read_text().strip()
    role = name.rsplit("-", 1)[0]

    async def run():
        refusals = []

        async def on_error(exc):
            refusals.append(str(exc))

        nc = await nats.connect(nats_url, nkeys_seed_str=seed, inbox_prefix=inbox_prefix(up.namespace, role, name),
                                error_cb=on_error, allow_reconnect=False)
        try:
            result = await act(nc, Subjects(up.namespace))
            await nc.flush()
            await asyncio.sleep(0.3)  # the server's -ERR for a refused publish comes asynchronously
            return result, refusals
        finally:
            await nc.close()

    return asyncio.run(run())


def stats_of(up, instance: str) -> ServiceStats:
    async def ask(nc, s):
        return ServiceStats.decode((await nc.request(s.stats(instance), StatsRequest().encode(), timeout=5)).data)

    return as_instance(up, "gateway-0", ask)[0]


@pytest.mark.timeout(240)
def test_a_decode_worker_switched_to_prefill_mid_stream_loses_nothing_and_switches_back(tmp_path, default_model):
    up = start_up(tmp_path / "run", "--topology", "disagg", "--decode", "2", "--role-switch", "--stop-timeout", "6")
    try:
        bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
                  for prompt in ("Once upon a time", "The list of primes", "In the beginning")]
        with ThreadPoolExecutor(len(bodies)) as pool:  # the undisturbed runs, side by side
            references = list(pool.map(lambda body: streamed_text(stream(up.url, body, timeout_s=120)), bodies))

        # Mid-stream: decode-1's streams run on for half a second, then move (as on a SIGTERM drain).
        with ThreadPoolExecutor(len(bodies)) as pool:
            streams = [pool.submit(stream, up.url, body, timeout_s=120) for body in bodies]
            wait_until(lambda: running_on(up.url, "decode-1") >= 1, 60, "decode-1 never ran a request", poll_s=0.1)
            switched = splitserve("switch", "decode-1", "prefill", "--drain", "0.5", "--run-dir", str(up.run_dir),
                                  "--json")
            outcomes = [s.result(timeout=150) for s in streams]
        assert switched.returncode == 0, switched.stderr
        answer = json.loads(switched.stdout)
        assert answer["role"] == "prefill" and answer["role_epoch"] == 1
        assert answer["drain_s"] >= 0.45  # it held a stream (none would have drained at once), then handed it back
        print(f"\nswitch decode->prefill: drain {answer['drain_s']:.3f} s, then serving in {answer['switch_s']:.3f} s")
        for events, reference in zip(outcomes, references):
            assert not [e for e in events if "error" in e], events[-3:]
            assert streamed_text(events) == reference  # nothing lost, nothing twice

        state = ps(up.run_dir)
        assert state["pools"] == {"decode": {"desired": 1, "running": 1, "retiring": 0},
                                  "prefill": {"desired": 2, "running": 2, "retiring": 0},
                                  "kvstore": {"desired": 1, "running": 1, "retiring": 0}}
        assert {s["name"]: s["role"] for s in state["services"]}["decode-1"] == "prefill"
        stats = stats_of(up, "decode-1")
        assert (stats.role, stats.role_epoch, stats.details["role_switch"]["switches"]) == ("prefill", 1, 1)
        assert stats.details["role_switch"]["last"]["switch_s"] < 5  # model loaded: about 0.1 s on an idle machine

        # After the switch: served as before (prompts prefilled by the pool, which decode-1 is part of now).
        assert streamed_text(stream(up.url, bodies[0])) == references[0]

        # A prefill job offered under decode-1's old epoch (0) is refused, for its decode worker to queue it.
        ticket = TransferTicket(transfer_id="t", token=b"x" * 16, deadline_unix_s=0,
                                endpoint=TransferEndpoint(host="127.0.0.1", port=1, host_id="h"))
        job = PrefillJob(request_id="stale-1", model=MODEL, prompt_token_ids=[1, 2], sampling=SamplingParams(),
                         ticket=ticket, reply_subject="x", block_size=16, model_fingerprint=b"f", deadline_ms=0,
                         created_ms=0, role_epoch=0)

        async def offer(nc, s):
            return HandoffReply.decode((await nc.request(s.prefill_offer("decode-1"), job.encode(), timeout=5)).data)

        refused = as_instance(up, "decode-0", offer)[0]
        assert (refused.accepted, refused.code) == (False, "stale_role")

        # No key but the admin's may switch a worker: the server refuses another's publish, and nothing switches.
        async def forge(nc, s):
            await nc.publish(s.role_switch("decode-1"), b"{}")

        _, refusals = as_instance(up, "gateway-0", forge)
        assert any("permissions violation" in r.lower() for r in refusals), refusals
        assert stats_of(up, "decode-1").role_epoch == 1

        # The control API's refusals, through the CLI.
        last = splitserve("switch", "decode-0", "prefill", "--run-dir", str(up.run_dir))
        assert last.returncode == 2 and "the last decode worker" in last.stderr
        same = splitserve("switch", "decode-1", "prefill", "--run-dir", str(up.run_dir))
        assert same.returncode == 2 and "decode-1 is prefill already" in same.stderr

        # And back: a decode worker again (epoch 2), serving streams exactly.
        back = splitserve("switch", "decode-1", "decode", "--run-dir", str(up.run_dir), "--wait", "--timeout", "60",
                          timeout_s=120)
        assert back.returncode == 0, back.stderr
        assert "switched decode-1 to decode (role epoch 2)" in back.stdout and "settled" in back.stdout
        assert ps(up.run_dir)["pools"]["decode"] == {"desired": 2, "running": 2, "retiring": 0}
        with ThreadPoolExecutor(len(bodies)) as pool:
            again = list(pool.map(lambda body: streamed_text(stream(up.url, body, timeout_s=120)), bodies))
        assert again == references
        assert up.stop() == 0
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
