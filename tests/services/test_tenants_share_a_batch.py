"""A worker shares its batch between tenants, on a real deployment (nats-server, the services, HTTP): with its two
places held by one tenant's long streams, another tenant's request takes one of them at once (the newest stream
is preempted, counted in /metrics) and ends while both streams still run; every text is the one each request
gets alone (greedy, so the preempted stream goes on exactly where it was)."""

import threading

import httpx
import pytest

from support.deployment import start_deployment
from support.metrics import matching, samples
from support.sse import stream, streamed_text
from support.waiting import wait_until

MODEL = "splitserve-default-llama"
NOISY, QUIET = "sk-noisy-key", "sk-quiet-key"


@pytest.fixture(scope="module")
def two_places(nats_server, default_model, tmp_path_factory):
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model,
                                  decode_args=("--max-num-seqs", "2"),
                                  gateway_args=("--api-key", f"{NOISY}:noisy", "--api-key", f"{QUIET}:quiet"))
    yield deployment
    deployment.stop()


def alone(deployment, body: dict, key: str) -> str:
    response = httpx.post(f"{deployment.api}/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def preemptions(deployment) -> float:
    return sum(matching(samples(deployment.base_url), "splitserve_engine_preemptions_total", reason="batch_share"))


@pytest.mark.timeout(300)
def test_a_full_batch_gives_a_place_to_another_tenant_and_every_stream_stays_exact(two_places):
    greedy = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    long_bodies = [{**greedy, "prompt": f"Noisy stream {i}: the tide came in", "max_tokens": 600} for i in range(2)]
    short_body = {**greedy, "prompt": "Quiet: a lighthouse keeper wrote", "max_tokens": 8}
    references = [alone(two_places, body, NOISY) for body in long_bodies]
    short_reference = alone(two_places, short_body, QUIET)
    before = preemptions(two_places)

    started = [threading.Event() for _ in long_bodies]
    streams: list[list[dict]] = [[] for _ in long_bodies]  # each stream's events so far (the list being read into)

    def arrived(i: int, events: list[dict]) -> None:
        streams[i] = events
        if events[-1]["choices"]:
            started[i].set()

    def read(i: int) -> None:
        stream(two_places.base_url, long_bodies[i], api_key=NOISY, on_chunk=lambda events: arrived(i, events))

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(long_bodies))]
    seen: list[list[dict]] = []
    for reader in readers:
        reader.start()
    try:
        for event in started:
            assert event.wait(60), "a long stream did not start"
        short = alone(two_places, short_body, QUIET)  # both places held: it takes one
        seen = [list(s) for s in streams]
    finally:
        for reader in readers:
            reader.join(120)
    assert short == short_reference
    assert not any(e["choices"] and e["choices"][0]["finish_reason"] for s in seen for e in s), \
        "a long stream had ended before the short request was served"
    assert [streamed_text(s) for s in streams] == references
    wait_until(lambda: preemptions(two_places) >= before + 1, 10, "the preemption counted in /metrics")
