"""No request lost. A stream whose worker dies, stalls or stops under it goes on on another worker: the client
sees one stream, every token once, the same text as an uninterrupted run (greedy and seeded sampling), in
colocated and disagg. A handoff nobody answers, and a full queue, tell the client when to come back."""

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from contracts import Assignment, CancelRequest, Subjects
from reference import safe_prompts
from support.deployment import start_deployment
from support.kv_workload import wait_until
from support.metrics import matching, samples, value
from support.sse import stream
from support.token_tap import BusTap, request_id_of

MODEL = "splitserve-default-llama"
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 11}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topology", ["colocated", "disagg"])
def test_a_stream_whose_worker_is_killed_goes_on_on_another_worker(nats_server, default_model, tmp_path, topology):
    disagg = topology == "disagg"
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2, prefill=int(disagg),
                                  scheduler_args=("--max-local-prefill", "0") if disagg else ())
    assignments = BusTap(deployment.nats_url, Subjects(deployment.namespace).tokens_wildcard("gateway-0"), Assignment)
    (prompt, _), = safe_prompts(default_model, 2048, [80], 1, seed=5)
    # Seeded sampling once (a moved request is prefilled where it decodes in either topology).
    samplings = {"greedy": SAMPLINGS["greedy"]} if disagg else SAMPLINGS
    try:
        for n, (name, sampling) in enumerate(samplings.items()):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True,
                    "stream_options": {"include_usage": True}, **sampling}
            reference = stream(deployment.base_url, body)
            killed = []

            def kill_the_owner(events):
                if len(events) == 20 and not killed:
                    rid = request_id_of(events[0])
                    owner = assignments.wait_for(lambda a: a.request_id == rid, 10, "no assignment").worker_instance
                    os.kill(deployment.procs[owner].pid, signal.SIGKILL)
                    killed.append(owner)

            events = stream(deployment.base_url, body, kill_the_owner)
            assert killed, "the stream ended before its worker could be killed"
            assert not [e for e in events if "error" in e], events[-3:]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            assert text == "".join(e["choices"][0]["text"] for e in reference if e["choices"]), name
            assert events[-1]["usage"]["completion_tokens"] == 200
            assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
            # Moved once, to the other worker; the killed one comes back (as its supervisor would start it) for the
            # next sampling's stream to have two workers again.
            rid = request_id_of(events[0])
            moved = assignments.wait_for(lambda a: a.request_id == f"{rid}-moved-1", 10, "never moved")
            assert moved.worker_instance != killed[0]
            if n == len(samplings) - 1:
                break
            deployment.restart(killed[0])
            wait_until(lambda: killed[0] in deployment.registered(), 60, "the killed worker never came back")
            deployment.wait_scheduler_sees("decode", 2)
        metrics = samples(deployment.base_url)
        # Each moved once: for the killed worker's silence (5 s, its stream's idle deadline) or its registry entry
        # lapsing (6 s), whichever the gateway saw first.
        assert sum(matching(metrics, "splitserve_request_migrations_total")) == len(samplings)
    finally:
        assignments.close()
        deployment.stop()


@pytest.mark.timeout(180)
def test_without_migration_a_killed_workers_stream_ends_with_an_error_event(nats_server, default_model, tmp_path):
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2,
                                  gateway_args=("--migration-limit", "0"))
    assignments = BusTap(deployment.nats_url, Subjects(deployment.namespace).tokens_wildcard("gateway-0"), Assignment)
    (prompt, _), = safe_prompts(default_model, 2048, [80], 1, seed=5)
    try:
        def kill_the_owner(events):
            if len(events) == 20:
                rid = request_id_of(events[0])
                owner = assignments.wait_for(lambda a: a.request_id == rid, 10, "no assignment").worker_instance
                os.kill(deployment.procs[owner].pid, signal.SIGKILL)

        events = stream(deployment.base_url, {"model": MODEL, "prompt": prompt, "max_tokens": 2000,
                                              "ignore_eos": True, "temperature": 0}, kill_the_owner)
        assert events[-1]["error"]["code"] == "worker_failed", events[-1]
    finally:
        assignments.close()
        deployment.stop()


@pytest.fixture(scope="module")
def one_worker(nats_server, default_model, tmp_path_factory):
    """One decode worker whose handoffs the scheduler waits a second for: a frozen worker's 503, and cancels."""
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model,
                                  scheduler_args=("--handoff-timeout", "1"))
    yield deployment
    deployment.stop()


@pytest.mark.timeout(120)
def test_a_handoff_nobody_answers_is_a_503_with_retry_after(one_worker, default_model):
    """A frozen worker still in the registry takes no request: the client is told to come back, not a 500."""
    deployment = one_worker
    (prompt, _), = safe_prompts(default_model, 2048, [20], 1, seed=5)
    os.kill(deployment.procs["decode-0"].pid, signal.SIGSTOP)
    try:
        response = httpx.post(f"{deployment.base_url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert response.status_code == 503, response.text
        assert "did not answer the handoff" in response.json()["error"]["message"]
        assert float(response.headers["retry-after"]) > 0
    finally:
        os.kill(deployment.procs["decode-0"].pid, signal.SIGCONT)


def sigterm_and_wait(proc) -> tuple[int, float]:
    """SIGTERM to a service: (its exit code, seconds it took)."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    return code, time.monotonic() - started


@pytest.mark.timeout(300)
def test_a_stalled_or_stopped_workers_stream_moves_and_the_worker_lets_it_go(nats_server, default_model, tmp_path):
    """1. Idle, a prefill worker and a decode worker stop at once on SIGTERM, exit 0.
    2. SIGSTOP of a stream's worker: its registry entry lapses (6 s), the gateway moves the stream, which ends as
       an uninterrupted run would; on SIGCONT the worker stops computing the request. Two things drop it there:
       the gateway's cancel, which NATS holds for the frozen connection, and the worker finding its entry lapsed
       (which alone serves when the connection did not survive the stall; tests/bus covers the lapse).
    3. SIGTERM of a stream's worker: it goes on streaming for its drain time (`--drain-timeout 1`), then hands
       the stream back and exits 0; the stream moves, unbroken."""
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=3, prefill=1,
                                  scheduler_args=("--max-local-prefill", "0"), decode_args=("--drain-timeout", "1"))
    assignments = BusTap(deployment.nats_url, Subjects(deployment.namespace).tokens_wildcard("gateway-0"), Assignment)
    (prompt, _), = safe_prompts(default_model, 2048, [80], 1, seed=5)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    stalled = []
    try:
        for name in ("prefill-0", "decode-2"):
            code, seconds = sigterm_and_wait(deployment.procs[name])
            assert code == 0 and seconds < 3, (name, code, seconds)
        deployment.wait_scheduler_sees("decode", 2)
        reference = "".join(e["choices"][0]["text"] for e in stream(deployment.base_url, body))

        def at_chunk_20(act):
            def on_chunk(events):
                if len(events) == 20:
                    rid = request_id_of(events[0])
                    owner = assignments.wait_for(lambda a: a.request_id == rid, 10, "no assignment").worker_instance
                    act(owner, rid)
            return on_chunk

        def stop(owner, rid):
            os.kill(deployment.procs[owner].pid, signal.SIGSTOP)
            stalled.append((owner, rid))

        events = stream(deployment.base_url, body, at_chunk_20(stop))
        owner, rid = stalled[0]
        assert not [e for e in events if "error" in e], events[-3:]
        assert "".join(e["choices"][0]["text"] for e in events) == reference

        def streamed_by_the_stalled_worker() -> int:
            return sum(len(c.token_ids) for c in deployment.tap.messages() if c.request_id == rid)

        before_waking = streamed_by_the_stalled_worker()
        os.kill(deployment.procs[owner].pid, signal.SIGCONT)
        wait_until(lambda: deployment.stats(owner).details["registry_lapses"] == 1, 20,
                   "the woken worker never saw its entry lapse")
        idle = wait_until(lambda: (info := deployment.stats(owner)).num_running + info.active_requests == 0 and info,
                          10, "the woken worker still runs the moved request")
        assert idle.state == "ready"
        # Idle, it streams no more; what it streamed before saying so reached the server before its answer did.
        deployment.tap.caught_up()
        # At most a step or two between waking and dropping it (unfenced, it would stream ~280 tokens more).
        assert streamed_by_the_stalled_worker() - before_waking <= 4
        deployment.wait_scheduler_sees("decode", 2)

        def chunks_of(rid: str) -> int:
            return sum(1 for c in deployment.tap.messages() if c.request_id == rid)

        terminated = []

        def terminate(owner, rid):
            deployment.procs[owner].send_signal(signal.SIGTERM)
            terminated.append((owner, rid, chunks_of(rid)))

        events = stream(deployment.base_url, body, at_chunk_20(terminate))
        owner, rid, chunks_before = terminated[0]
        assert chunks_of(rid) - chunks_before >= 10  # it streamed on while draining
        assert not [e for e in events if "error" in e], events[-3:]
        assert "".join(e["choices"][0]["text"] for e in events) == reference
        assert assignments.wait_for(lambda a: a.request_id == f"{rid}-moved-1", 10, "never moved").worker_instance != owner
        assert deployment.procs[owner].wait(timeout=30) == 0
    finally:
        for owner, _ in stalled:
            with contextlib.suppress(ProcessLookupError):  # it may have been the one stopped afterwards
                os.kill(deployment.procs[owner].pid, signal.SIGCONT)
        assignments.close()
        deployment.stop()


@pytest.mark.timeout(120)
def test_a_cancel_the_client_did_not_send_ends_its_stream_at_once_and_one_before_the_handoff_is_refused(
        one_worker, default_model):
    """1. A cancel of a streaming request that its gateway did not send (lost track of, or forged): the worker
       stops it and says so; the client's stream ends with a `cancelled` error event at once, not at a deadline.
    2. A client that leaves while its request waits in the queue (the scheduler frozen): the cancel reaches the
       worker before the handoff does, and the worker refuses the handoff, never computing it."""
    deployment = one_worker
    (prompt, _), = safe_prompts(default_model, 2048, [20], 1, seed=5)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    subjects = Subjects(deployment.namespace)
    deployment.wait_scheduler_sees("decode", 1)  # (the worker may just have been frozen, by the test above)
    try:
        sent = []

        def cancel_at_chunk_5(events):
            if len(events) == 5:
                sent.append(time.monotonic())
                deployment.publish(subjects.cancel, CancelRequest(request_id=request_id_of(events[0]), reason="x"))

        events = stream(deployment.base_url, body, cancel_at_chunk_5)
        assert events[-1]["error"]["code"] == "cancelled", events[-2:]
        assert time.monotonic() - sent[0] < 3  # not at an idle deadline
        assert len(events) < 200 and not any("error" in e for e in events[:-1])
        assert deployment.stats("decode-0").active_requests == 0

        taken = deployment.stats("decode-0").handoffs_taken
        rejected = deployment.stats("scheduler-0").details["routed"].get("rejected", 0)
        os.kill(deployment.procs["scheduler"].pid, signal.SIGSTOP)
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=1.5)
            # The gateway forgets the request (and sends its cancel) once it sees the client gone.
            wait_until(lambda: value(samples(deployment.base_url), "splitserve_gateway_requests_waiting") == 0, 10,
                       "the gateway never saw the client leave")
        finally:
            os.kill(deployment.procs["scheduler"].pid, signal.SIGCONT)
        # The scheduler offers it once it wakes, and the worker refuses it.
        wait_until(lambda: deployment.stats("scheduler-0").details["routed"].get("rejected", 0) > rejected, 20,
                   "the woken scheduler's handoff was never refused")
        info = deployment.stats("decode-0")
        assert (info.handoffs_taken, info.active_requests, info.num_running) == (taken, 0, 0)
        response = httpx.post(f"{deployment.base_url}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert response.status_code == 200  # and the worker serves on
    finally:
        os.kill(deployment.procs["scheduler"].pid, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_past_the_waiting_bound_a_request_gets_429_and_the_admitted_ones_are_served(nats_server, default_model,
                                                                                     tmp_path):
    """With --max-waiting-requests 2 and the only worker frozen, two requests wait; the next ones are refused at
    once with 429 and Retry-After; once the worker wakes, the two admitted ones are served."""
    deployment = start_deployment(nats_server.url, tmp_path, default_model, scheduler_args=("--handoff-timeout", "30"),
                                  gateway_args=("--max-waiting-requests", "2"))
    (prompt, _), = safe_prompts(default_model, 2048, [20], 1, seed=5)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    os.kill(deployment.procs["decode-0"].pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            admitted = [pool.submit(httpx.post, f"{deployment.base_url}/v1/completions", json=body, timeout=90)
                        for _ in range(2)]

            wait_until(lambda: value(samples(deployment.base_url), "splitserve_gateway_requests_waiting") == 2, 20,
                       "the two requests never waited", poll_s=0.1)
            response = httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=5)
            assert response.status_code == 429, response.text
            assert float(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "queue_full"
            os.kill(deployment.procs["decode-0"].pid, signal.SIGCONT)
            assert [f.result().status_code for f in admitted] == [200, 200]
        assert value(samples(deployment.base_url), "splitserve_requests_total", endpoint="completions",
                     status="queue_full") >= 1
    finally:
        os.kill(deployment.procs["decode-0"].pid, signal.SIGCONT)
        deployment.stop()
