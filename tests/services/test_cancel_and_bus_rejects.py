"""Client disconnects cancel the request and free its KV; malformed bus messages are rejected, never fatal; a request queued twice
runs once."""

import asyncio
import json
import time

import httpx
import msgpack
import nats

from contracts import GenerateRequest, RequestFailed, ServiceStats, StatsRequest, Subjects
from shared.engine.sampling_params import SamplingParams
from support.token_tap import request_id_of
from support.waiting import eventually

MODEL = "splitserve-default-llama"


async def worker_stats(nc, subjects: Subjects, instance: str = "decode-0") -> ServiceStats:
    reply = await nc.request(subjects.stats(instance), StatsRequest().encode(), timeout=5)
    return ServiceStats.decode(reply.data)


def test_client_disconnect_frees_the_requests_blocks(colocated):
    async def scenario():
        nc = await nats.connect(colocated.nats_url)
        subjects = Subjects(colocated.namespace)
        try:
            body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse", "max_tokens": 3000,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=colocated.base_url, timeout=60) as http:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    events = []
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(json.loads(line[len("data: "):]))
                        if len(events) >= 5:
                            break
                    busy = await worker_stats(nc, subjects)
                    assert busy.num_running == 1 and busy.kv_blocks_free < busy.kv_blocks_total

            async def freed():
                stats = await worker_stats(nc, subjects)
                return stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total

            await eventually(freed, timeout_s=10, what="the request's blocks freed after the disconnect")
            # Freed by the cancel, not by finishing: far fewer than its 3000 tokens were made.
            request_id = request_id_of(events[0])
            made = sum(len(c.token_ids) for c in colocated.tap.messages() if c.request_id == request_id)
            assert 5 <= made < 1000, made
        finally:
            await nc.close()

    asyncio.run(scenario())


def test_malformed_and_wrong_version_messages_are_rejected(colocated):
    async def scenario():
        nc = await nats.connect(colocated.nats_url)
        subjects = Subjects(colocated.namespace)
        try:
            generate = subjects.worker_generate("decode-0")
            good = GenerateRequest(request_id="r1", model=MODEL, prompt_token_ids=[1, 2], sampling=SamplingParams(),
                                   reply_subject="_INBOX.none", deadline_ms=0, created_ms=0)
            wrong_version = msgpack.packb({**msgpack.unpackb(good.encode()), "v": 99})
            for payload in (b"\xc1\x00garbage", msgpack.packb([1, 2, 3]), wrong_version,
                            msgpack.packb({"type": "generate_request", "v": 1, "request_id": "r2"})):
                reply = await nc.request(generate, payload, timeout=5)
                failure = RequestFailed.decode(reply.data)
                assert failure.code == "invalid_request"
            # The JetStream request queue: the scheduler terminates what does not decode.
            js = nc.jetstream()
            await js.publish(subjects.submit, b"not msgpack at all", headers={"Nats-Msg-Id": "bad-1"})
            await js.publish(subjects.submit, wrong_version, headers={"Nats-Msg-Id": "bad-2"})
            deadline = time.monotonic() + 5
            while True:
                scheduler = await worker_stats(nc, subjects, "scheduler-0")
                if sum(scheduler.details.get("rejected_messages", {}).values()) >= 2:
                    break
                assert time.monotonic() < deadline, scheduler.details
                await asyncio.sleep(0.2)
            stats = await worker_stats(nc, subjects)
            assert sum(stats.details["rejected_messages"].values()) >= 4
        finally:
            await nc.close()

    asyncio.run(scenario())
    # Both receivers still serve.
    response = httpx.post(f"{colocated.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                          timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


def test_a_request_queued_twice_is_routed_once(colocated):
    """The request queue de-duplicates by request id: the gateway queues a request with its id as Nats-Msg-Id, so
    JetStream drops a copy sent again; a copy under another message id (as one sent past the stream's window
    would be) reaches the scheduler, which knows the id and does not route it again."""
    async def scenario():
        nc = await nats.connect(colocated.nats_url)
        subjects = Subjects(colocated.namespace)
        try:
            queued = await nc.subscribe(subjects.submit)  # a plain subscriber sees what the gateway queues
            await nc.flush()
            async with httpx.AsyncClient(base_url=colocated.base_url, timeout=60) as http:
                response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert response.status_code == 200
            msg = await queued.next_msg(timeout=5)
            request = GenerateRequest.decode(msg.data)
            assert request.request_id == request_id_of(response.json()) == msg.headers["Nats-Msg-Id"]
            routed = (await worker_stats(nc, subjects, "scheduler-0")).details["routed"]

            js = nc.jetstream()
            again = await js.publish(subjects.submit, msg.data, headers=msg.headers)
            assert again.duplicate  # the stream kept nothing
            stream = await js.stream_info(subjects.requests_stream)
            assert stream.state.messages == 0 and stream.state.last_seq == again.seq

            other_id = await js.publish(subjects.submit, msg.data, headers={"Nats-Msg-Id": request.request_id + "-b"})
            assert not other_id.duplicate and other_id.seq == again.seq + 1
            deadline = time.monotonic() + 10
            while (now := (await worker_stats(nc, subjects, "scheduler-0")).details["routed"]).get("duplicate", 0) \
                    == routed.get("duplicate", 0):
                assert time.monotonic() < deadline, now
                await asyncio.sleep(0.1)
            assert now == {**routed, "duplicate": routed.get("duplicate", 0) + 1}  # nothing else was routed
            worker = await worker_stats(nc, subjects)
            assert worker.num_running == worker.num_waiting == 0
        finally:
            await nc.close()

    asyncio.run(scenario())
