"""The bus trusts only the deployment's services, each role only within its job (issue 13, item 1).

A real `splitserve up` (disagg, kv-store, remote prefill) with its generated
credentials; every refusal is checked by the server's answer *and* by an admin
subscriber that would see the message had it got through, next to an allowed
publish of the same kind that it does see.
"""

import asyncio
import json
import subprocess
import sys
import uuid

import httpx
import nats
import pytest

from contracts import KVStoreLookup, RequestFailed, ServiceInfo, Subjects, TokenChunk
from services.launcher.nats_auth import creds_path, ensure_credentials
from shared.bus.permissions import inbox_prefix
from support.processes import ROOT, find_nats_server, free_port, jetstream_ready, service_env
from support.up import MODEL, start_up
from support.waiting import eventually, server_has, wait_until

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory, default_model):
    run = start_up(tmp_path_factory.mktemp("secured") / "run", "--topology", "disagg", "--max-local-prefill", "0")
    yield run
    run.stop()


def nats_url(run) -> str:
    return json.loads((run.run_dir / "deployment.json").read_text())["nats"]["url"]


class Client:
    """One connection with a role's credentials; `errors` holds what the server refused."""

    def __init__(self, run, role: str):
        self.run, self.role, self.errors = run, role, []

    async def __aenter__(self):
        async def on_error(exc):
            self.errors.append(str(exc))

        self.nc = await nats.connect(nats_url(self.run), nkeys_seed=str(creds_path(self.run.run_dir / "creds", self.role)),
                                     inbox_prefix=inbox_prefix(self.run.namespace, self.role), error_cb=on_error,
                                     allow_reconnect=False, name=f"test-{self.role}")
        return self

    async def __aexit__(self, *exc):
        await self.nc.close()

    async def refused(self, what: str, subject: str, timeout_s: float = 5.0) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        wanted = f'permissions violation for {what} to "{subject}"'.lower()
        while asyncio.get_running_loop().time() < deadline:
            if any(wanted in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.05)
        return False


class Watcher:
    """An admin connection seeing every subject, to tell what got through. The server handles a refused publish before
    it answers the refusal, so had it got through the watcher would see it before anything published after that
    answer: `sees` a control published after it, or `sees_everything_before` (its own publish), and then look."""

    def __init__(self, run):
        self.run, self.seen = run, []

    async def __aenter__(self):
        self.nc = await nats.connect(nats_url(self.run), nkeys_seed=str(creds_path(self.run.run_dir / "creds", "admin")),
                                     allow_reconnect=False)
        await self.nc.subscribe(">", cb=self._on)
        await server_has(self.nc)
        return self

    async def _on(self, msg):
        self.seen.append(msg.subject)

    async def __aexit__(self, *exc):
        await self.nc.close()

    async def sees(self, subject: str) -> None:
        await eventually(lambda: subject in self.seen, what=f"the watcher never saw {subject}")

    async def sees_everything_before(self) -> None:
        """Until the watcher has seen everything the server handled before now."""
        marker = f"_test.marker.{uuid.uuid4().hex}"
        await self.nc.publish(marker, b"")
        await self.sees(marker)


def test_an_unauthenticated_or_unknown_client_is_refused(secured, tmp_path):
    stranger = tmp_path / "stranger"
    ensure_credentials(stranger, roles=("gateway",))  # a well-formed key the server never heard of

    async def main():
        for options in ({}, {"nkeys_seed": str(creds_path(stranger, "gateway"))}):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(nats_url(secured), allow_reconnect=False, connect_timeout=2, **options)
        async with Client(secured, "gateway") as gateway:  # control: the deployment's own key is let in
            assert gateway.nc.is_connected

    asyncio.run(main())


def forged_chunk(request_id: str) -> bytes:
    return TokenChunk(request_id=request_id, seq=0, token_ids=[1], text="attacker text", finished=True,
                      finish_reason="stop").encode()


@pytest.mark.parametrize("role, kind", [
    ("gateway", "chunk"), ("kvstore", "chunk"), ("prefill", "chunk"), ("kvstore", "failure"), ("gateway", "failure"),
])
def test_only_workers_and_the_scheduler_may_publish_into_a_request_stream(secured, role, kind):
    subjects = Subjects(secured.namespace)

    async def main():
        async with Watcher(secured) as watcher, Client(secured, role) as forger, Client(secured, "decode") as worker:
            request_id = uuid.uuid4().hex
            subject = subjects.tokens("gateway-0", request_id)
            body = forged_chunk(request_id) if kind == "chunk" else RequestFailed(
                request_id=request_id, code="internal", message="forged").encode()
            await forger.nc.publish(subject, body)
            assert await forger.refused("publish", subject)
            allowed = subjects.tokens("gateway-0", uuid.uuid4().hex)  # control: a decode worker's chunk gets through
            await worker.nc.publish(allowed, body)
            await watcher.sees(allowed)
            assert subject not in watcher.seen
            assert not worker.errors

    asyncio.run(main())


@pytest.mark.parametrize("role", ["gateway", "kvstore", "prefill"])
def test_no_role_can_register_a_fake_decode_worker(secured, role):
    bucket = Subjects(secured.namespace).registry_bucket

    async def main():
        async with Watcher(secured) as watcher, Client(secured, role) as forger:
            fake = ServiceInfo(instance_id="decode-fake", role="decode", state="ready", max_num_seqs=64).encode()
            subject = f"$KV.{bucket}.decode.decode-fake"
            await forger.nc.publish(subject, fake)
            assert await forger.refused("publish", subject)
            # Under its own role's keys the entry lands, but readers see it does not match its key and skip it.
            from shared.bus.registry import Registry

            own = f"$KV.{bucket}.{role}.decode-fake"
            await forger.nc.publish(own, fake)
            await watcher.sees(own)
            assert subject not in watcher.seen
            registry = await Registry.open(watcher.nc.jetstream(), bucket)
            assert "decode-fake" not in [s.instance_id for s in await registry.list()]
            assert registry.num_malformed >= 1

    asyncio.run(main())


@pytest.mark.parametrize("endpoint", ["lookup", "get", "put"])
def test_the_gateway_cannot_reach_the_kv_store(secured, endpoint):
    subject = Subjects(secured.namespace).kvstore("kvstore-0", endpoint)

    async def main():
        async with Watcher(secured) as watcher, Client(secured, "gateway") as gateway, \
                Client(secured, "decode") as worker:
            body = KVStoreLookup(hashes=[b"\x00" * 16]).encode()
            with pytest.raises(nats.errors.Error):  # timeout or no responders: the request never went out
                await gateway.nc.request(subject, body, timeout=1.0)
            assert await gateway.refused("publish", subject)
            await watcher.sees_everything_before()
            assert subject not in watcher.seen
            if endpoint == "lookup":  # control: a worker's lookup is answered
                reply = await worker.nc.request(subject, body, timeout=5.0)
                assert reply.data

    asyncio.run(main())


@pytest.mark.parametrize("role, pattern", [
    ("gateway", ">"),  # everything: prompts, outputs, tickets
    ("gateway", "{ns}.worker.*.generate"),  # requests (prompts) handed to workers
    ("kvstore", "{ns}.tokens.>"),  # other users' outputs
    ("decode", "_INBOX.>"),  # every role's replies
    ("prefill", "_INBOX.{ns}.gateway.>"),  # the gateway's replies
])
def test_roles_cannot_listen_outside_their_job(secured, role, pattern):
    pattern = pattern.format(ns=secured.namespace)

    async def main():
        async with Client(secured, role) as listener:
            refused = await listener.nc.subscribe(pattern)  # no callback: what it gets stays queued, in order
            assert await listener.refused("subscription", pattern)
            own = await listener.nc.subscribe(listener.nc.new_inbox())  # control: its own inbox, which it may hear
            await server_has(listener.nc)
            async with Client(secured, "admin") as admin:
                await admin.nc.publish(pattern.replace(">", "probe").replace("*", "probe"), b"x")
                await admin.nc.publish(own.subject, b"x")  # after the probe, from the same connection
                await admin.nc.flush()
            await own.next_msg(timeout=5)  # had the probe got through, it came before this
            assert refused.pending_msgs == 0

    asyncio.run(main())


def test_the_gateway_cannot_read_or_take_the_request_queue(secured):
    subjects = Subjects(secured.namespace)

    async def main():
        async with Client(secured, "gateway") as gateway, Client(secured, "scheduler") as scheduler:
            with pytest.raises(Exception):
                await gateway.nc.jetstream(timeout=1.0).pull_subscribe(subjects.submit, durable="thief",
                                                                       stream=subjects.requests_stream)
            assert await gateway.refused("publish", f"$JS.API.CONSUMER.INFO.{subjects.requests_stream}.thief") or \
                await gateway.refused("publish", f"$JS.API.CONSUMER.CREATE.{subjects.requests_stream}.thief")
            # control: the scheduler reads its own consumer
            info = await scheduler.nc.jetstream(timeout=5.0).consumer_info(subjects.requests_stream,
                                                                          subjects.scheduler_consumer)
            assert info.name == subjects.scheduler_consumer

    asyncio.run(main())


def test_the_secured_deployment_serves_and_no_service_is_refused(secured):
    response = httpx.post(f"{secured.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 4})
    assert response.status_code == 200, response.text
    logs = sorted((secured.run_dir / "logs").glob("*.log"))
    assert {"gateway-0.log", "scheduler-0.log", "decode-0.log", "prefill-0.log", "kvstore-0.log"} <= {p.name for p in logs}
    for path in logs:
        if path.name != "nats.log":  # the server logs the tests' refused attempts
            assert "nats refused" not in path.read_text(), path.name
    for path in [secured.run_dir / "creds", *(secured.run_dir / "creds").iterdir(), secured.run_dir / "nats.conf"]:
        assert path.stat().st_mode & 0o077 == 0, path


def test_a_deployment_on_your_own_nats_server_with_nats_auth_credentials(tmp_path):

    creds, namespace = tmp_path / "creds", "ext" + uuid.uuid4().hex[:6]
    cli = [sys.executable, "-m", "services.cli.main"]
    made = subprocess.run([*cli, "nats-auth", str(creds), "--namespace", namespace], capture_output=True, text=True,
                          env=service_env(), cwd=ROOT, timeout=60)
    assert made.returncode == 0, made.stderr
    assert creds.stat().st_mode & 0o077 == 0 and all(p.stat().st_mode & 0o077 == 0 for p in creds.iterdir()
                                                     if p.name != "public")  # (the CA certificate, for all)
    port = free_port()
    server = subprocess.Popen([find_nats_server(), "--jetstream", "--config", str(creds / "nats-auth.conf"), "--addr",
                               "127.0.0.1", "--port", str(port), "--store_dir", str(tmp_path / "js")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    try:
        doctor = [*cli, "doctor", "--nats", url, "--json", "--run-dir", str(tmp_path / "doctor")]
        wait_until(lambda: jetstream_ready(port), 10, "the nats-server never listened with JetStream on", poll_s=0.05)
        result = subprocess.run([*doctor, "--nats-creds", str(creds / "admin.nk")], capture_output=True, text=True,
                                env=service_env(), cwd=ROOT, timeout=60)
        checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
        assert checks["nats"]["status"] == "ok", checks["nats"]
        result = subprocess.run(doctor, capture_output=True, text=True, env=service_env(), cwd=ROOT, timeout=60)
        assert "Authorization Violation" in result.stdout  # without credentials, refused

        run = start_up(tmp_path / "run", "--nats", url, "--nats-creds-dir", str(creds), namespace=namespace)
        try:
            response = httpx.post(f"{run.url}/v1/completions", timeout=60,
                                  json={"model": MODEL, "prompt": "hello", "max_tokens": 3})
            assert response.status_code == 200, response.text
            services = json.loads((run.run_dir / "deployment.json").read_text())["services"]
            for service in services:  # each service holds its own role's credentials, no other
                assert service["argv"][service["argv"].index("--nats-creds") + 1] == str(creds / f"{service['role']}.nk")
        finally:
            run.stop()
    finally:
        server.terminate()
        server.wait(timeout=10)
