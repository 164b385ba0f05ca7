"""The chaos suite: faults injected with real signals under steady streaming load, counting requests lost.

Two of every role (schedulers, prefill workers, decode workers, kv-stores) behind one gateway, on a NATS server
of its own. Four clients stream greedy requests back to back while, one after another, each role gets a kill -9
(and is started again, as a supervisor would) or a SIGSTOP long enough for its registry entry to lapse (a decode
worker both), then NATS restarts, then the workers restart in turn (SIGTERM, drain, start again). The claim: no
request is lost (every one is served, its stream ending without an error event, after at most a few retries where
the gateway said to retry: a 429/503 with Retry-After before the first byte, as the `openai` client retries) and
every text is the uninterrupted run's.
"""

import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from reference import safe_prompts
from support.deployment import start_deployment
from support.kv_workload import wait_until
from support.metrics import samples, value
from support.processes import NatsServer
from services.gateway.readiness import fully_ready

MODEL = "splitserve-default-llama"
CLIENTS = 4
FREEZE_S = 7.5  # past the registry's 6 s TTL and the streams' 5 s idle deadline


RETRIES = 3  # on a 429/503 with Retry-After before the first byte, as the `openai` client does (2 by default)


def stream_text(base_url: str, body: dict) -> tuple[str, str | None, int]:
    """(the streamed text, None, retries) or (what there was, the failure: an HTTP status or an error event's
    code, retries)."""
    for retry in range(RETRIES + 1):
        text, failure, retry_after = _stream_once(base_url, body)
        if retry_after is None or retry == RETRIES:
            return text, failure, retry
        time.sleep(min(retry_after, 2.0))


def _stream_once(base_url: str, body: dict) -> tuple[str, str | None, float | None]:
    text = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            retry_after = response.headers.get("retry-after")
            told_to_retry = response.status_code in (429, 503) and retry_after is not None
            return "", f"HTTP {response.status_code}: {response.text[:200]}", float(retry_after) if told_to_retry else None
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return "".join(text), f"{event['error'].get('code')}: {event['error'].get('message')}", None
            text.extend(c["text"] for c in event["choices"])
    return "".join(text), None, None


@dataclass
class Load:
    """Clients streaming back to back until stopped; every outcome kept, by the fault under way when it began."""
    base_url: str
    bodies: list[dict]
    references: list[str]
    fault: str = "warm-up"
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (fault, "ok" | what went wrong)
    retried: Counter = field(default_factory=Counter)  # fault -> requests served after a 429/503 with Retry-After
    in_flight: set = field(default_factory=set)  # the requests under way now (by number)
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, n: int) -> None:
        i = n
        while not self.stopping.is_set():
            k = i % len(self.bodies)
            fault = self.fault
            number = (n, i)
            with self.lock:
                self.in_flight.add(number)
            try:
                text, failure, retries = stream_text(self.base_url, self.bodies[k])
            except httpx.HTTPError as exc:
                text, failure, retries = "", repr(exc), 0
            if failure is None and text != self.references[k]:
                failure = f"text differs from the uninterrupted run (prompt {k})"
            with self.lock:
                self.outcomes.append((fault, failure or "ok"))
                self.retried[fault] += bool(retries)
                self.in_flight.discard(number)
            i += 1

    def completed(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def under_way(self) -> set:
        with self.lock:
            return set(self.in_flight)


def wait_whole(deployment, timeout_s: float = 60.0) -> None:
    """Until /ready says every service of the deployment is ready again."""
    def whole():
        try:
            response = httpx.get(f"{deployment.base_url}/ready", timeout=5)
        except httpx.HTTPError:
            return False
        return fully_ready(response.status_code, response.text)
    wait_until(whole, timeout_s, "the deployment never became whole again", poll_s=0.2)


@pytest.mark.timeout(900)
def test_no_request_is_lost_to_kills_freezes_a_nats_restart_or_a_rolling_restart(default_model, tmp_path):
    nats = NatsServer(tmp_path / "nats")
    nats.start()
    deployment = start_deployment(nats.url, tmp_path, default_model, schedulers=2, prefill=2, workers=2,
                                  kvstore_args=(), kvstores=2, decode_args=("--drain-timeout", "1"))
    prompts = safe_prompts(default_model, 2048, [24, 60, 120, 200], 40, seed=9)  # no near-ties in 40 tokens
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
              for prompt, _ in prompts]
    frozen: list[int] = []
    try:
        references = []
        for body in bodies:
            text, failure, _ = stream_text(deployment.base_url, body)
            assert failure is None, failure
            references.append(text)
        load = Load(deployment.base_url, bodies, references)
        clients = [threading.Thread(target=load.client, args=(n,), daemon=True) for n in range(CLIENTS)]
        for client in clients:
            client.start()

        def under(fault: str, act, settle_s: float = 1.0) -> None:
            """One fault at a time: the next comes once the deployment is whole again, every request under way
            by then has ended (a dead worker's go on elsewhere: they may still be moving), and some more ran."""
            load.fault = fault
            act()
            wait_whole(deployment)
            hit = load.under_way()
            wait_until(lambda: not hit & load.under_way(), 90, f"requests under way after {fault} never ended")
            before = load.completed()
            wait_until(lambda: load.completed() >= before + CLIENTS, 60, f"no request completed after {fault}")
            time.sleep(settle_s)

        def kill(name: str):
            def act():
                os.kill(deployment.procs[name].pid, signal.SIGKILL)
                time.sleep(1.0)
                deployment.restart(name)
                # Whole again means the new process registered, not the dead one's entry still there.
                wait_until(lambda: (entry := deployment.registry_entries().get(f"{name}-0" if name == "scheduler"
                                                                              else name))
                           and entry.pid == deployment.procs[name].pid, 60, f"{name} never came back")
            return act

        def freeze(name: str):
            def act():
                pid = deployment.procs[name].pid
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
                time.sleep(FREEZE_S)
                os.kill(pid, signal.SIGCONT)
                frozen.remove(pid)
            return act

        def restart_nats():
            nats.stop()
            time.sleep(1.0)
            nats.start()

        def rolling_restart():
            # Both decode workers (the streams of the first move to the second, which then goes too), one of each
            # other role.
            for name in ("decode-0", "decode-1", "prefill-1", "scheduler-1", "kvstore-1"):
                deployment.procs[name].send_signal(signal.SIGTERM)
                assert deployment.procs[name].wait(timeout=20) == 0, name
                deployment.restart(name)
                wait_whole(deployment)

        wait_until(lambda: load.completed() >= 2 * CLIENTS, 60, "the load never got going")
        # Every role faulted: a decode worker killed and frozen (its streams move either way), a prefill worker
        # killed mid-job (redelivered), a scheduler frozen past its lease, a kv-store killed (misses meanwhile).
        for fault, name in (("kill -9", "decode-0"), ("SIGSTOP", "decode-1"), ("kill -9", "prefill-0"),
                            ("SIGSTOP", "scheduler-1"), ("kill -9", "kvstore-0")):
            under(f"{fault} {name}", (kill if fault == "kill -9" else freeze)(name))
        under("nats restart", restart_nats)
        under("rolling restart", rolling_restart)
        load.stopping.set()
        for client in clients:
            client.join(timeout=150)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        deployment.stop()
        nats.stop()

    by_fault = Counter(fault for fault, _ in load.outcomes)
    lost = [(fault, outcome) for fault, outcome in load.outcomes if outcome != "ok"]
    print(f"chaos: {len(load.outcomes)} requests, by fault: {dict(by_fault)}; served after a retry: "
          f"{dict(load.retried)}; lost: {len(lost)}")
    assert not lost, lost
    assert all(by_fault[fault] > 0 for fault in ("kill -9 decode-0", "SIGSTOP decode-1", "nats restart"))


def shm_segments() -> set[str]:
    """The KV side channel's shared-memory segments on this machine (shared.transfer.shm names them ssk-...)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("ssk-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(600)
def test_a_thousand_clients_leaving_at_random_points_leave_nothing_held(nats_server, default_model, tmp_path):
    """1,000 streamed requests in disagg (remote prefills over shm, the kv-store on), 32 at a time, each client
    gone at a random point: before its first byte (queued, prefilling, its KV in flight) or after a few tokens.
    Afterwards every worker is back at its baseline: no request held, every KV block free, no prefill job, no
    kv-store put in flight, no shared-memory segment left, nothing waiting at the gateway."""
    import asyncio
    import random

    deployment = start_deployment(nats_server.url, tmp_path, default_model, prefill=1, kvstore_args=(),
                                  scheduler_args=("--max-local-prefill", "16"), prefill_args=("--kv-transport", "shm"))
    prompts = [prompt for prompt, _ in safe_prompts(default_model, 2048, [12, 40, 90, 160], 1, seed=3)]
    # Segments of other processes on this machine (other tests' deployments, say) are none of these workers'.
    outside = len(shm_segments()) - sum(deployment.stats(n).details["shm_segments"]["made"]
                                        for n in ("decode-0", "prefill-0"))
    rng = random.Random(7)
    plans = [(rng.choice(prompts), rng.random() < 0.5, rng.uniform(0.0, 0.6), rng.randint(1, 12)) for _ in range(1000)]
    served = Counter()

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, plan) -> None:
        prompt, by_time, after_s, after_chunks = plan
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "ignore_eos": True, "temperature": 0,
                "stream": True}

        async def read() -> None:
            chunks = 0
            async with client.stream("POST", f"{deployment.base_url}/v1/completions", json=body) as response:
                served[response.status_code] += 1
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
                    if not by_time and chunks >= after_chunks:
                        return  # leaves after a few tokens (the connection closes)

        async with gate:
            try:
                if by_time:
                    await asyncio.wait_for(read(), after_s)  # gone wherever the request is by then
                else:
                    await read()
            except TimeoutError:
                served["left"] += 1

    async def run() -> None:
        gate = asyncio.Semaphore(32)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)  # each client its own connection
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(one(client, gate, plan) for plan in plans))

    try:
        asyncio.run(run())
        assert set(served) <= {200, "left"} and served["left"] > len(plans) // 5 and served[200] > len(plans) // 2, served

        def held() -> dict:
            """What is not back at its baseline (nothing, once all is let go)."""
            decode, prefill = deployment.stats("decode-0"), deployment.stats("prefill-0")
            shm = {key: decode.details["shm_segments"][key] + prefill.details["shm_segments"][key]
                   for key in ("made", "in_use", "leaked")}
            found = {
                "decode requests": (decode.num_running, decode.num_waiting, decode.active_requests),
                "decode blocks in use": decode.kv_blocks_total - decode.kv_blocks_free,
                "prefill jobs": prefill.num_running,
                "prefill blocks in use": prefill.kv_blocks_total - prefill.kv_blocks_free,
                "kv-store puts": deployment.stats("kvstore-0").details["puts_in_flight"],
                "gateway waiting": value(samples(deployment.base_url), "splitserve_gateway_requests_waiting"),
                "shm segments in use": shm["in_use"],
                # A sender keeps a few segments to reuse (bounded by its pool's cap) and a process its long-lived
                # regions (a KV cache, a lease table); any other is a leak, and so is one on disk nobody holds.
                "shm segments leaked": shm["leaked"],
                "shm segments nobody holds": len(shm_segments()) - shm["made"] - outside,
            }
            return {what: n for what, n in found.items() if n and n != (0, 0, 0)}

        try:
            wait_until(lambda: not held(), 60, "everything let go", poll_s=0.5)
        except AssertionError:
            assert held() == {}, "still held after the clients left"
        # And it serves as before.
        text, failure, _ = stream_text(deployment.base_url, {"model": MODEL, "prompt": prompts[-1], "max_tokens": 8,
                                                             "temperature": 0})
        assert failure is None and text, failure
    finally:
        deployment.stop()
