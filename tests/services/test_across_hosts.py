"""One deployment across three "hosts" (network namespaces on one bridge, see `support.netns`), each service
started as an operator would on its own machine (`splitserve serve ROLE --nats URL,URL,URL`):

    host a: nats-a, scheduler-0, gateway-0     host b: nats-b, prefill-0     host c: nats-c, decode-0, kvstore-0

The three NATS servers are one cluster (routes between the hosts, every stream on all three, each role with
its own NKey). A prompt is prefilled on b and its KV crosses to c over the TCP side channel, TLS only
(certificates from the deployment's CA naming each host), to the address decode-0 found routes to NATS. Greedy
output is transformers'; a NATS node killed under streaming load costs no request; host b cut off: requests are
prefilled on c within the job deadline, and on b again once it is back.
"""

import time

import httpx
import pytest
from transformers import AutoTokenizer

from loadtest.across_hosts import HostsDeployment
from loadtest.netns import Hosts, netns_unavailable
from reference import safe_prompts
from support.jetstream import all_current
from support.metrics import matching, samples
from support.sse import stream, streamed_text
from support.waiting import wait_until

MODEL = "splitserve-default-llama"
NAMESPACE = "hosts"
GATEWAY = "http://127.0.0.1:8000"  # on host a, where the client threads are


@pytest.fixture
def hosts():
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"cannot build hosts from network namespaces here: {reason}")
    made = Hosts(["a", "b", "c"])
    yield made
    made.close()


def complete(across: HostsDeployment, prompt, max_tokens: int, retries: int = 0) -> httpx.Response:
    """A completion from host a; with `retries`, a 503 is sent again after its Retry-After, as the official
    OpenAI client does (twice by default)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    for _ in range(retries + 1):
        response = across.on("a", httpx.post, GATEWAY + "/v1/completions", json=body, timeout=120)
        if response.status_code != 503:
            break
        time.sleep(float(response.headers.get("retry-after", 1)))  # as long as the gateway said, as a client would
    return response


def metric(across: HostsDeployment, name: str, **labels) -> float:
    return sum(matching(across.on("a", samples, GATEWAY), name, **labels))


@pytest.mark.timeout(600)
def test_a_deployment_across_three_hosts_serves_exactly_and_rides_out_a_nats_node_and_a_cut_host(
        hosts, tmp_path, default_model):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    cases = safe_prompts(default_model, 2048, [20, 150, 400], 16, seed=3)
    across = HostsDeployment(hosts, tmp_path, NAMESPACE, tls=True)
    model = ["--model", default_model, "--served-model-name", MODEL]
    engine = [*model, "--kv-cache-bytes", str(64 << 20)]
    try:
        across.start_nats()
        across.serve("a", "scheduler", "scheduler-0", "--max-local-prefill", "0")
        across.serve("c", "kvstore", "kvstore-0")
        across.serve("b", "prefill", "prefill-0", *engine, "--kv-store")
        across.serve("c", "decode", "decode-0", *engine, "--mode", "disagg", "--kv-store", "--prefill-timeout", "5")
        across.serve("a", "gateway", "gateway-0", *model, "--port", "8000",
                     "--expect", "scheduler=1,decode=1,prefill=1,kvstore=1")
        try:
            wait_until(lambda: across.gateway_ready(GATEWAY), 180, "the deployment across hosts never said ready",
                       poll_s=1.0)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{across.report()}") from None
        wait_until(lambda: across.workers_seen().get("prefill"), 30, "the scheduler never saw prefill-0")

        # Exact, prefilled on b, its KV over TCP to c (no shared memory between hosts).
        for prompt, expected in cases:
            response = complete(across, prompt, 16)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        # The gateway's /metrics asks the workers on the other hosts for their figures.
        wait_until(lambda: metric(across, "splitserve_prefill_outcomes_total", instance="decode-0",
                                         outcome="remote") == len(cases), 10, "not every prompt was prefilled on b")
        assert metric(across, "splitserve_kv_transfer_bytes_total", instance="decode-0", backend="tcp") > 0
        assert not metric(across, "splitserve_kv_transfer_bytes_total", instance="decode-0", backend="shm")
        # The decode worker advertised the address that routes to NATS, its host's, not loopback.
        decode_log = (tmp_path / "decode-0.log").read_text()
        assert f'"advertise_host": "{hosts.address["c"]}"' in decode_log
        assert '"tls": true' in next(line for line in decode_log.splitlines() if "kv receiver listening" in line)

        # (a) The gateway's NATS node killed under six streams (and started again, as its supervisor would): none
        # lost. Chunks sent while the gateway reconnects are lost with the node; each broken stream goes on from
        # what its client has, on decode-0 again (the only worker there is, and not at fault).
        body = {"model": MODEL, "prompt": "A story about the sea", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0}
        reference = streamed_text(across.on("a", stream, GATEWAY, body))
        victim = across.nats_node_of("gateway-0")
        killed = []

        def kill_a_node(events):
            if len(events) == 30 and not killed:
                across.procs[victim].kill()
                killed.append(time.monotonic())

        runs = [across.clients["a"].submit(stream, GATEWAY, body, kill_a_node if i == 0 else lambda events: None)
                for i in range(6)]
        results = [run.result(timeout=300) for run in runs]
        assert killed, "the streams ended before the node could be killed"
        assert not [e for events in results for e in events if "error" in e]
        assert [streamed_text(events) for events in results] == [reference] * 6
        across.restart(victim)
        wait_until(lambda: across.gateway_ready(GATEWAY), 60, f"not ready again after {victim} came back", poll_s=1.0)
        # Every stream's copy on the victim caught up: another node's loss now keeps a quorum.
        wait_until(lambda: across.on("a", all_current, across.nats_url, str(across.creds / "admin.nk")), 60,
                   f"{victim}'s copies never caught up", poll_s=1.0)

        # (b) Host b cut off: prompts are prefilled on c (at worst after the 5 s job deadline), none fails.
        prompt, expected = cases[1]
        remote_before = metric(across, "splitserve_prefill_outcomes_total", instance="decode-0", outcome="remote")
        hosts.cut("b")
        started = time.monotonic()
        # (While the cluster re-elects the leaders host b held, a request may be told to come back: a client's
        # retry of a 503 is part of the contract; no request ends in an error past it.)
        for _ in range(3):
            response = complete(across, prompt, 16, retries=2)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert time.monotonic() - started < 3 * 40
        assert metric(across, "splitserve_prefill_outcomes_total", instance="decode-0", outcome="remote") == remote_before
        # Back: prefill-0 serves again (its NATS node rejoins, its entry is read again).
        hosts.mend("b")

        def prefilled_on_b():
            response = complete(across, prompt, 4, retries=2)
            assert response.status_code == 200, response.text
            return metric(across, "splitserve_prefill_outcomes_total", instance="decode-0", outcome="remote") > remote_before

        wait_until(prefilled_on_b, 120, "remote prefill did not resume once host b was back", poll_s=1.0)
    finally:
        across.stop()
