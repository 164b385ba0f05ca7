"""One deployment across three "hosts" (network namespaces on one bridge, see `support.netns`), each service
started as an operator would on its own machine (`splitserve serve ROLE --nats URL,URL,URL`):

    host a: nats-a, scheduler-0, gateway-0     host b: nats-b, prefill-0     host c: nats-c, decode-0, kvstore-0

The three NATS servers are one cluster (routes between the hosts, every stream on all three, each role with
its own NKey). A prompt is prefilled on b and its KV crosses to c over the TCP side channel, to the address
decode-0 found routes to NATS. Greedy output is transformers'; a NATS node killed under streaming load costs no
request; host b cut off: requests are prefilled on c within the job deadline, and on b again once it is back.
"""

import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import nats
import pytest
from transformers import AutoTokenizer

from contracts import ServiceInfo, StatsRequest, Subjects
from reference import safe_prompts
from services.launcher.nats_server import ClusterRoutes, host_port, jetstream_answers
from shared.bus.credentials import credentials_from
from support.jetstream import all_current
from support.metrics import matching, samples
from loadtest.netns import Hosts, netns_unavailable
from support.processes import ROOT, find_nats_server, service_env, stop_process
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


class AcrossHosts:
    def __init__(self, hosts: Hosts, tmp_path, model_dir: str):
        self.hosts, self.dir, self.model_dir = hosts, tmp_path, model_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[str, list[str]]] = {}
        self.client = ThreadPoolExecutor(8, initializer=hosts.thread_in, initargs=("a",))  # HTTP from host a
        self.creds = tmp_path / "creds"
        subprocess.run([sys.executable, "-m", "services.cli.main", "nats-auth", str(self.creds), "--namespace",
                        NAMESPACE], check=True, capture_output=True, env=service_env(), cwd=ROOT, timeout=60)
        self.nats_url = ",".join(f"nats://{hosts.address[h]}:4222" for h in "abc")

    def start(self, host: str, name: str, argv: list[str]) -> None:
        self.commands[name] = (host, argv)
        log = open(self.dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            self.hosts.command(host, argv), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env=service_env(SPLITSERVE_HOST_ID=f"host-{host}"))  # other machines: no shared memory between them

    def restart(self, name: str) -> None:
        stop_process(self.procs[name])
        self.start(name=name, host=self.commands[name][0], argv=self.commands[name][1])

    def start_nats(self) -> None:
        routes = tuple(host_port(self.hosts.address[h], 6222) for h in "abc")
        for h in "abc":
            address = self.hosts.address[h]
            config = self.creds / f"nats-{h}.conf"  # beside nats-auth.conf, which it includes
            config.write_text(
                f'server_name: "nats-{h}"\nlisten: "{host_port(address, 4222)}"\n'
                f'jetstream {{ store_dir: "{self.dir / ("store-" + h)}" }}\ninclude "nats-auth.conf"\n'
                + ClusterRoutes("splitserve", host_port(address, 6222), routes, "route", "route-secret").config())
            self.start(h, f"nats-{h}", [find_nats_server(), "-c", str(config)])
        admin = self.creds / "admin.nk"
        wait_until(lambda: self.on_a(jetstream_answers, self.nats_url, admin), 30, "the cluster's JetStream")

    def serve(self, host: str, role: str, instance: str, *args: str) -> None:
        self.start(host, instance, [sys.executable, "-m", "services.cli.main", "serve", role, "--nats", self.nats_url,
                                    "--namespace", NAMESPACE, "--nats-creds", str(self.creds / f"{role}.nk"),
                                    "--instance-id", instance, *args])

    def on_a(self, fn, *args, **kwargs):
        return self.client.submit(fn, *args, **kwargs).result(timeout=300)

    def get(self, path: str) -> httpx.Response:
        return self.on_a(httpx.get, GATEWAY + path, timeout=10)

    def complete(self, prompt, max_tokens: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return self.on_a(httpx.post, GATEWAY + "/v1/completions", json=body, timeout=120)

    def workers_seen(self) -> dict[str, int]:
        """The roles scheduler-0 sees ready (asked over NATS as the operator, from host a)."""
        async def ask():
            options = credentials_from(str(self.creds / "admin.nk"), environ={}).connect_options()
            nc = await nats.connect(servers=self.nats_url.split(","), **options)
            try:
                reply = await nc.request(Subjects(NAMESPACE).stats("scheduler-0"), StatsRequest().encode(), timeout=5)
                return ServiceInfo.decode(reply.data).details["workers_seen"]
            finally:
                await nc.close()
        return self.on_a(asyncio.run, ask())

    def metric(self, name: str, **labels) -> float:
        return sum(matching(self.on_a(samples, GATEWAY), name, **labels))

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):  # the services, then NATS
            stop_process(proc)
        self.client.shutdown(wait=False, cancel_futures=True)


@pytest.mark.timeout(600)
def test_a_deployment_across_three_hosts_serves_exactly_and_rides_out_a_nats_node_and_a_cut_host(
        hosts, tmp_path, default_model):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    cases = safe_prompts(default_model, 2048, [20, 150, 400], 16, seed=3)
    across = AcrossHosts(hosts, tmp_path, default_model)
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
        wait_until(lambda: _ready(across), 180, "the deployment across hosts never said ready", poll_s=1.0)
        wait_until(lambda: across.workers_seen().get("prefill"), 30, "the scheduler never saw prefill-0")

        # Exact, prefilled on b, its KV over TCP to c (no shared memory between hosts).
        for prompt, expected in cases:
            response = across.complete(prompt, 16)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        # (The workers' figures reach /metrics with their next heartbeat.)
        wait_until(lambda: across.metric("splitserve_prefill_outcomes_total", instance="decode-0",
                                         outcome="remote") == len(cases), 10, "not every prompt was prefilled on b")
        assert across.metric("splitserve_kv_transfer_bytes_total", instance="decode-0", backend="tcp") > 0
        assert not across.metric("splitserve_kv_transfer_bytes_total", instance="decode-0", backend="shm")
        # The decode worker advertised the address that routes to NATS, its host's, not loopback.
        decode_log = (tmp_path / "decode-0.log").read_text()
        assert f'"advertise_host": "{hosts.address["c"]}"' in decode_log

        # (a) A NATS node killed under six streams (and started again, as its supervisor would): none lost.
        body = {"model": MODEL, "prompt": "A story about the sea", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0}
        reference = streamed_text(across.on_a(stream, GATEWAY, body))
        killed = []

        def kill_a_node(events):
            if len(events) == 30 and not killed:
                across.procs["nats-c"].kill()
                killed.append(time.monotonic())

        runs = [across.client.submit(stream, GATEWAY, body, kill_a_node if i == 0 else lambda events: None)
                for i in range(6)]
        results = [run.result(timeout=300) for run in runs]
        assert killed, "the streams ended before the node could be killed"
        assert not [e for events in results for e in events if "error" in e]
        assert [streamed_text(events) for events in results] == [reference] * 6
        across.restart("nats-c")
        wait_until(lambda: _ready(across), 60, "not ready again after nats-c came back", poll_s=1.0)
        # Every stream's copy on c caught up: another node's loss now keeps a quorum.
        wait_until(lambda: across.on_a(all_current, across.nats_url, str(across.creds / "admin.nk")), 60,
                   "nats-c's copies never caught up", poll_s=1.0)

        # (b) Host b cut off: prompts are prefilled on c (at worst after the 5 s job deadline), none fails.
        prompt, expected = cases[1]
        time.sleep(2.5)  # decode-0's last figures in (with its next heartbeat)
        remote_before = across.metric("splitserve_prefill_outcomes_total", instance="decode-0", outcome="remote")
        hosts.cut("b")
        started = time.monotonic()
        for _ in range(3):
            response = across.complete(prompt, 16)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert time.monotonic() - started < 3 * 20
        time.sleep(2.5)
        assert across.metric("splitserve_prefill_outcomes_total", instance="decode-0", outcome="remote") == remote_before
        # Back: prefill-0 serves again (its NATS node rejoins, its entry is read again).
        hosts.mend("b")

        def prefilled_on_b():
            response = across.complete(prompt, 4)
            assert response.status_code == 200, response.text
            return across.metric("splitserve_prefill_outcomes_total", instance="decode-0", outcome="remote") > remote_before

        wait_until(prefilled_on_b, 120, "remote prefill did not resume once host b was back", poll_s=1.0)
    finally:
        across.stop()


def _ready(across: AcrossHosts) -> bool:
    try:
        response = across.get("/ready")
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and json.loads(response.text)["status"] == "ready"
