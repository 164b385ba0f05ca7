"""The chaos suite: faults injected with real signals under steady streaming load, counting requests lost.

Two of every role (schedulers, prefill workers, decode workers, kv-stores) behind one gateway, on a NATS server
of its own. Four clients stream greedy requests back to back while, one after another: a decode worker is killed
(kill -9, and started again, as a supervisor would) and the other frozen (SIGSTOP past its streams' idle deadline),
each while it streams; a prefill worker is killed holding a job it pulled from the queue; a scheduler is frozen
past its requests' ack wait holding one; a kv-store is killed; then NATS restarts, then the services restart in
turn (SIGTERM, drain, start again: one decode worker, then the other with one of every other role). Each fault
is checked to have done what it does, by the services' own counters: the streams moved, the job redelivered,
the request taken over by the other scheduler, the kv-store missed. The claim: no request is lost (every one is
served, its stream ending without an error event, after at most a few retries where the gateway said to retry:
a 429/503 with Retry-After before the first byte, as the `openai` client retries) and every text is the
uninterrupted run's.
"""

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import nats
import pytest

from reference import safe_prompts
from support.deployment import start_deployment
from support.kv_workload import wait_until
from support.metrics import matching, samples, value
from support.processes import NatsServer
from support.waiting import became
from contracts import Subjects
from services.common.queues import REQUEST_ACK_WAIT_S
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
        time.sleep(min(retry_after, 2.0))  # as told (at most 2 s), as the `openai` client waits


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
            self.request((n, i), self.bodies[k], self.references[k], f"prompt {k}")
            i += 1

    def request(self, number, body: dict, reference: str, what: str) -> None:
        """One request, its outcome kept (a failure, or a text other than `reference`, is a lost request)."""
        fault = self.fault
        with self.lock:
            self.in_flight.add(number)
        try:
            text, failure, retries = stream_text(self.base_url, body)
        except httpx.HTTPError as exc:
            text, failure, retries = "", repr(exc), 0
        if failure is None and text != reference:
            failure = f"text differs from the uninterrupted run ({what})"
        with self.lock:
            self.outcomes.append((fault, failure or "ok"))
            self.retried[fault] += bool(retries)
            self.in_flight.discard(number)

    def aside(self, number, body: dict, reference: str, what: str) -> threading.Thread:
        """One request beside the clients' (started now, on a thread of its own)."""
        thread = threading.Thread(target=self.request, args=(number, body, reference, what), daemon=True)
        thread.start()
        return thread

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


def consumer_info(deployment, stream: str, consumer: str):
    """The JetStream consumer's state as the server has it now (pending, ack pending, waiting pulls)."""
    async def ask():
        nc = await nats.connect(deployment.nats_url)
        try:
            return await nc.jetstream().consumer_info(stream, consumer)
        finally:
            await nc.close()
    return asyncio.run(ask())


def kill_once_pulled(deployment, name: str, stream: str, consumer: str) -> bool:
    """Let frozen `name` go on, and kill -9 it as soon as the consumer has a message delivered and not acked (the
    only other puller is frozen: it is `name`'s). Whether it died with the message still unacked (mid-job)."""
    async def watch() -> bool:
        nc = await nats.connect(deployment.nats_url)
        try:
            js = nc.jetstream()
            pid = deployment.procs[name].pid
            held = (await js.consumer_info(stream, consumer)).num_ack_pending  # by the frozen: held still
            os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while (await js.consumer_info(stream, consumer)).num_ack_pending == held:
                assert time.monotonic() < deadline, f"{name} never pulled the job (waited 10 s)"
            os.kill(pid, signal.SIGKILL)
            deployment.procs[name].wait(timeout=10)
            return (await js.consumer_info(stream, consumer)).num_ack_pending > held
        finally:
            await nc.close()
    return asyncio.run(watch())


def migrations(deployment) -> float:
    """Streams the gateway moved to another worker so far (whatever they moved on from)."""
    return sum(matching(samples(deployment.base_url), "splitserve_request_migrations_total"))


def kv_store_misses(deployment, workers) -> int:
    """The model workers' kv-store misses so far: lookups that found less than the whole prefix, and lookups, gets
    and puts that failed (an instance gone, a refusal, a failed transfer)."""
    total = 0
    for name in workers:
        tier = deployment.stats(name).details["kv_store"]
        total += tier["counts"].get("lookup_misses", 0) + sum(tier["misses"].values())
    return total


@pytest.mark.timeout(900)
def test_no_request_is_lost_to_kills_freezes_a_nats_restart_or_a_rolling_restart(default_model, tmp_path):
    nats_server = NatsServer(tmp_path / "nats")
    nats_server.start()
    deployment = start_deployment(nats_server.url, tmp_path, default_model, schedulers=2, prefill=2, workers=2,
                                  kvstore_args=(), kvstores=2, decode_args=("--drain-timeout", "1", "--kv-store"),
                                  prefill_args=("--kv-store",))
    prompts = safe_prompts(default_model, 2048, [24, 60, 120, 200], 40, seed=9)  # no near-ties in 40 tokens
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
              for prompt, _ in prompts]
    # A prompt long enough (and, salted afresh each time, cached nowhere) to be prefilled remotely, from the queue.
    [(long_prompt, _)] = safe_prompts(default_model, 2048, [1500], 40, seed=9)
    long_body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    subjects = Subjects(deployment.namespace)
    model_workers = ("decode-0", "decode-1", "prefill-0", "prefill-1")
    frozen: list[int] = []
    effects: dict[str, float] = {}  # fault -> how much of what it should cause it caused
    try:
        # The uninterrupted runs, all at once (greedy output does not depend on the batch it ran in).
        with ThreadPoolExecutor(len(bodies) + 1) as pool:
            runs = list(pool.map(lambda body: stream_text(deployment.base_url, body),
                                 [*bodies, {**long_body, "cache_salt": "reference"}]))
        assert [failure for _, failure, _ in runs] == [None] * len(runs), runs
        *references, long_reference = [text for text, _, _ in runs]
        load = Load(deployment.base_url, bodies, references)
        clients = [threading.Thread(target=load.client, args=(n,), daemon=True) for n in range(CLIENTS)]
        for client in clients:
            client.start()

        def under(fault: str, act) -> None:
            """One fault at a time: the next comes once the deployment is whole again, every request under way
            by then has ended (a dead worker's go on elsewhere: they may still be moving), and some more ran."""
            load.fault = fault
            act()
            wait_whole(deployment)
            hit = load.under_way()
            wait_until(lambda: not hit & load.under_way(), 90, f"requests under way after {fault} never ended")
            before = load.completed()
            wait_until(lambda: load.completed() >= before + CLIENTS, 60, f"no request completed after {fault}")

        def stop(name: str) -> None:
            pid = deployment.procs[name].pid
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)

        def go_on(name: str) -> None:
            pid = deployment.procs[name].pid
            os.kill(pid, signal.SIGCONT)
            frozen.remove(pid)

        def back(name: str) -> None:
            """Start killed `name` again, as a supervisor would, until the new process registered (not the dead
            one's entry still there)."""
            deployment.restart(name)
            wait_until(lambda: (entry := deployment.registry_entries().get(f"{name}-0" if name == "scheduler"
                                                                          else name))
                       and entry.pid == deployment.procs[name].pid, 60, f"{name} never came back")

        def with_streams(name: str) -> None:
            """Until decode worker `name` is streaming (a fault then has streams to move)."""
            wait_until(lambda: deployment.stats(name).active_requests > 0, 30, f"{name} never had a stream")

        def kill_decode_streaming(name: str):
            def act():
                moved = migrations(deployment)  # before: the scrape takes a while, and a stream may end meanwhile
                with_streams(name)
                os.kill(deployment.procs[name].pid, signal.SIGKILL)
                deployment.procs[name].wait(timeout=10)
                time.sleep(1.0)  # the fault: gone a second before a supervisor starts it again
                back(name)
                effects[f"kill -9 {name}: streams moved"] = wait_until(
                    lambda: migrations(deployment) - moved, 60, f"no stream of {name} moved after its kill")
            return act

        def freeze_decode_streaming(name: str):
            def act():
                moved = migrations(deployment)  # before: the scrape takes a while, and a stream may end meanwhile
                with_streams(name)
                stop(name)
                # Frozen past its streams' idle deadline: they move (the fault is the stall's length).
                time.sleep(FREEZE_S)
                go_on(name)
                effects[f"SIGSTOP {name}: streams moved"] = wait_until(
                    lambda: migrations(deployment) - moved, 60, f"no stream of {name} moved while it was frozen")
            return act

        def kill_prefill_mid_job():
            """prefill-0 killed holding a job it pulled and had not acked; redelivered to another worker."""
            queue = (subjects.prefill_stream, subjects.prefill_consumer)
            baseline = deployment.stats("prefill-1").details["jobs"].get("redelivered", 0)
            for attempt in range(3):
                for name in ("prefill-0", "prefill-1"):
                    stop(name)
                # Their pull requests lapse (a second each): then nothing takes the next job off the queue.
                wait_until(lambda: consumer_info(deployment, *queue).num_waiting == 0, 10,
                           "the frozen prefill workers' pull requests never lapsed", poll_s=0.05)
                load.aside(("long", attempt), {**long_body, "cache_salt": f"chaos-{attempt}"}, long_reference,
                           "the long prompt")
                wait_until(lambda: consumer_info(deployment, *queue).num_pending > 0, 30,
                           "the long prompt's prefill job never queued", poll_s=0.05)
                frozen.remove(deployment.procs["prefill-0"].pid)
                mid_job = kill_once_pulled(deployment, "prefill-0", *queue)
                go_on("prefill-1")
                back("prefill-0")
                if mid_job:
                    break
            assert mid_job, "prefill-0 finished its job each time before it could be killed"

            def redelivered():
                return (deployment.stats("prefill-1").details["jobs"].get("redelivered", 0) - baseline
                        + deployment.stats("prefill-0").details["jobs"].get("redelivered", 0))
            effects["kill -9 prefill-0: jobs redelivered"] = wait_until(
                redelivered, 30, "the job prefill-0 died with was never redelivered")

        def freeze_scheduler_past_its_lease():
            """scheduler-1 frozen with a request it pulled, past the request's ack wait: scheduler-0 takes it."""
            baseline = deployment.stats("scheduler-0").details["redelivered"]
            took_over = lambda: deployment.stats("scheduler-0").details["redelivered"] - baseline
            for attempt in range(3):
                stop("scheduler-1")
                # A burst at once, while its pull request is still at the server: one of them lands there.
                for k, body in enumerate(bodies):
                    load.aside(("burst", attempt, k), body, references[k], f"prompt {k}")
                landed = became(took_over, REQUEST_ACK_WAIT_S + 5)
                go_on("scheduler-1")
                if landed:
                    break
                wait_whole(deployment)
            effects["SIGSTOP scheduler-1: requests taken over"] = wait_until(
                took_over, 5, "no request scheduler-1 held was taken over by scheduler-0")

        def kill_kvstore():
            misses = kv_store_misses(deployment, model_workers)
            os.kill(deployment.procs["kvstore-0"].pid, signal.SIGKILL)
            deployment.procs["kvstore-0"].wait(timeout=10)
            time.sleep(1.0)  # the fault: gone a second before a supervisor starts it again
            back("kvstore-0")
            # Missed while it was gone, and after: it came back empty.
            effects["kill -9 kvstore-0: kv-store misses"] = wait_until(
                lambda: kv_store_misses(deployment, model_workers) - misses, 60, "no kv-store miss after its kill")

        def restart_nats():
            nats_server.stop()
            time.sleep(1.0)  # the fault: the bus gone for a second
            nats_server.start()

        def rolling_restart():
            # Both decode workers (the streams of the first move to the second, which then goes too), one of each
            # other role. Each role keeps a member serving throughout: the second wave restarts one of every role
            # at once (roles do not stand in for each other).
            for wave in (("decode-0",), ("decode-1", "prefill-1", "scheduler-1", "kvstore-1")):
                for name in wave:
                    deployment.procs[name].send_signal(signal.SIGTERM)
                for name in wave:
                    assert deployment.procs[name].wait(timeout=20) == 0, name
                    deployment.restart(name)
                wait_whole(deployment)

        wait_until(lambda: load.completed() >= 2 * CLIENTS, 60, "the load never got going")
        # Every role faulted: a decode worker killed and frozen (its streams move either way), a prefill worker
        # killed mid-job (redelivered), a scheduler frozen past its lease (taken over), a kv-store killed (misses).
        under("kill -9 decode-0", kill_decode_streaming("decode-0"))
        under("SIGSTOP decode-1", freeze_decode_streaming("decode-1"))
        under("kill -9 prefill-0", kill_prefill_mid_job)
        under("SIGSTOP scheduler-1", freeze_scheduler_past_its_lease)
        under("kill -9 kvstore-0", kill_kvstore)
        under("nats restart", restart_nats)
        under("rolling restart", rolling_restart)
        load.stopping.set()
        for client in clients:
            client.join(timeout=150)
        assert not any(client.is_alive() for client in clients), "a client never finished its last request"
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        deployment.stop()
        nats_server.stop()

    by_fault = Counter(fault for fault, _ in load.outcomes)
    lost = [(fault, outcome) for fault, outcome in load.outcomes if outcome != "ok"]
    print(f"chaos: {len(load.outcomes)} requests, by fault: {dict(by_fault)}; served after a retry: "
          f"{dict(load.retried)}; lost: {len(lost)}; effects: {effects}")
    assert not lost, lost


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

        if not became(lambda: not held(), 60, poll_s=0.5):
            pytest.fail(f"still held 60 s after the clients left: {held()}")
        # And it serves as before.
        text, failure, _ = stream_text(deployment.base_url, {"model": MODEL, "prompt": prompts[-1], "max_tokens": 8,
                                                             "temperature": 0})
        assert failure is None and text, failure
    finally:
        deployment.stop()
