"""One stolen NATS key, tried as an attacker would (issue 35, items 1, 2 and 5): identity is per instance.

A real deployment (`splitserve up`, disagg, kv-store, remote prefill) on an operator's own nats-server, with the
per-instance credentials `splitserve nats-auth` writes and the streams `up` provisioned with the admin key. The
attacker holds one instance's key (a running worker's, or an instance that is admitted but not running). Every
refusal is checked by the server's answer *and* by what got through: an admin watcher that would have seen the
message, the gateway's and the services' counts of what they dropped, and the client's text.
"""

import asyncio
import json
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import nats.js.errors
import pytest

from contracts import (KVEvents, KVStoreLookup, KVStoreReply, PrefillResult, RequestFailed, RoleSwitch, ServiceInfo,
                       ServiceStats, StatsRequest, Subjects, TokenChunk, sent_by)
from services.cli.nats_auth import DEFAULT_INSTANCES
from services.launcher.nats_auth import creds_path, ensure_credentials
from shared.bus.permissions import inbox_prefix
from support.metrics import samples, value
from support.processes import ROOT, find_nats_server, free_port, jetstream_ready, service_env
from support.sse import stream, streamed_text
from support.up import MODEL, UpRun, start_up
from support.waiting import eventually, server_has, wait_until

pytestmark = [pytest.mark.timeout(300)]
ROLE_OF = {i.instance_id: i.role for i in DEFAULT_INSTANCES} | {"admin": "admin"}
RUNNING = ("gateway-0", "scheduler-0", "decode-0", "prefill-0", "kvstore-0")  # what the deployment starts


@dataclass
class Deployment:
    run: UpRun
    nats_url: str
    creds: Path

    @property
    def namespace(self) -> str:
        return self.run.namespace

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)


@pytest.fixture(scope="module")
def secured(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("secured")
    creds, namespace = root / "creds", "sec" + uuid.uuid4().hex[:8]
    made = subprocess.run([sys.executable, "-m", "services.cli.main", "nats-auth", str(creds), "--namespace",
                           namespace], capture_output=True, text=True, env=service_env(), cwd=ROOT, timeout=60)
    assert made.returncode == 0, made.stderr
    port = free_port()
    server = subprocess.Popen([find_nats_server(), "--jetstream", "--config", str(creds / "nats-auth.conf"), "--addr",
                               "127.0.0.1", "--port", str(port), "--store_dir", str(root / "js")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    try:
        wait_until(lambda: jetstream_ready(port), 10, "the nats-server never listened with JetStream on", poll_s=0.05)
        run = start_up(root / "run", "--topology", "disagg", "--max-local-prefill", "0", "--nats", url,
                       "--nats-creds-dir", str(creds), namespace=namespace)
        try:
            yield Deployment(run, url, creds)
        finally:
            run.stop()
    finally:
        server.terminate()
        server.wait(timeout=10)


class Client:
    """One connection holding one instance's key (the admin's: `admin`); `errors` holds what the server refused."""

    def __init__(self, deployment: Deployment, instance_id: str):
        self.deployment, self.instance_id, self.errors = deployment, instance_id, []

    async def __aenter__(self):
        async def on_error(exc):
            self.errors.append(str(exc))

        role = ROLE_OF.get(self.instance_id)
        options = {"inbox_prefix": inbox_prefix(self.deployment.namespace, role, self.instance_id)} if role else {}
        self.nc = await nats.connect(self.deployment.nats_url, error_cb=on_error, allow_reconnect=False,
                                     nkeys_seed=str(creds_path(self.deployment.creds, self.instance_id)),
                                     name=f"attacker-{self.instance_id}", **options)
        return self

    async def __aexit__(self, *exc):
        await self.nc.close()

    async def refused(self, what: str, subject: str, timeout_s: float = 5.0) -> bool:
        wanted = f'permissions violation for {what} to "{subject}"'.lower()
        try:
            await eventually(lambda: any(wanted in e.lower() for e in self.errors), timeout_s=timeout_s, what=wanted)
        except AssertionError:
            return False
        return True


async def stats_of(admin: Client, instance_id: str) -> ServiceStats:
    reply = await admin.nc.request(admin.deployment.subjects.stats(instance_id), StatsRequest().encode(), timeout=10)
    return ServiceStats.decode(reply.data)


async def subjects_seen(watcher: Client, pattern: str) -> list[str]:
    """The subjects of what `watcher` hears on `pattern` from now on, in order (filled as it arrives)."""
    seen: list[str] = []

    async def on_message(msg):
        seen.append(msg.subject)

    await watcher.nc.subscribe(pattern, cb=on_message)
    await server_has(watcher.nc)
    return seen


def forged_count(deployment: Deployment) -> float:
    return value(samples(deployment.run.url), "splitserve_gateway_forged_events_total")


def test_an_unauthenticated_or_unknown_client_is_refused(secured, tmp_path):
    from services.launcher.nats_auth import Instance

    stranger = tmp_path / "stranger"
    ensure_credentials(stranger, [Instance("gateway", "gateway-0")])  # a well-formed key the server never heard of

    async def main():
        for options in ({}, {"nkeys_seed": str(creds_path(stranger, "gateway-0"))}):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(secured.nats_url, allow_reconnect=False, connect_timeout=2, **options)
        async with Client(secured, "gateway-0") as gateway:  # control: the deployment's own key is let in
            assert gateway.nc.is_connected

    asyncio.run(main())


def test_a_requests_tokens_and_failures_are_believed_only_from_its_worker(secured):
    """The keys that may sign token events (the scheduler's, an idle stage's) forge chunks and failures into a live
    request; a worker's key cannot even sign as the scheduler. The client's text is what the real worker made."""
    body = {"model": MODEL, "prompt": "the same prompt, twice", "max_tokens": 96, "temperature": 0,
            "ignore_eos": True}
    reference = httpx.post(f"{secured.run.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    forged_before = forged_count(secured)
    subjects = secured.subjects

    async def attack():
        async with Client(secured, "admin") as watcher, Client(secured, "scheduler-0") as scheduler, \
                Client(secured, "stage-0") as stage, Client(secured, "decode-0") as decode:
            attacked: set[str] = set()
            sent_forgeries = asyncio.Event()

            async def on_event(msg):
                request_id = msg.subject.split(".")[-3]
                if request_id in attacked:
                    return
                attacked.add(request_id)
                base = subjects.tokens("gateway-0", request_id)
                for seq in range(1, 4):
                    chunk = TokenChunk(request_id=request_id, seq=seq, token_ids=[1], text=" FORGED",
                                       finished=seq == 3, finish_reason="stop" if seq == 3 else None).encode()
                    await scheduler.nc.publish(sent_by(base, "scheduler", "scheduler-0"), chunk)
                    await stage.nc.publish(sent_by(base, "decode", "stage-0"), chunk)
                failure = RequestFailed(request_id=request_id, code="invalid_request", message="FORGED").encode()
                await scheduler.nc.publish(sent_by(base, "scheduler", "scheduler-0"), failure)
                await stage.nc.publish(sent_by(base, "stage", "stage-0"), failure)
                posing = sent_by(base, "scheduler", "decode-0")  # a worker's key signing as the scheduler
                await decode.nc.publish(posing, failure)
                await scheduler.nc.flush()
                await stage.nc.flush()
                assert await decode.refused("publish", posing)
                sent_forgeries.set()

            await watcher.nc.subscribe(f"{subjects.namespace}.tokens.gateway-0.>", cb=on_event)
            await server_has(watcher.nc)
            text = streamed_text(await asyncio.to_thread(stream, secured.run.url, body))
            await asyncio.wait_for(sent_forgeries.wait(), 10)
            assert not scheduler.errors and not stage.errors  # they may sign: what they signed was dropped
            return text

    assert asyncio.run(attack()) == reference
    assert forged_count(secured) >= forged_before + 8


def test_no_service_key_can_change_purge_or_delete_a_shared_stream(secured):
    subjects = secured.subjects
    streams = [f"KV_{subjects.registry_bucket}", subjects.prefill_stream, subjects.requests_stream]

    async def main():
        for instance in [*RUNNING, "stage-0"]:
            async with Client(secured, instance) as attacker:
                for stream in streams:
                    for verb in ("UPDATE", "PURGE", "DELETE"):
                        subject = f"$JS.API.STREAM.{verb}.{stream}"
                        await attacker.nc.publish(subject, b"{}")
                        assert await attacker.refused("publish", subject), (instance, subject)
                consumer = f"$JS.API.CONSUMER.DELETE.{subjects.requests_stream}.{subjects.scheduler_consumer}"
                await attacker.nc.publish(consumer, b"")
                assert await attacker.refused("publish", consumer), instance
        async with Client(secured, "admin") as admin:  # control, and proof: the registry is as provisioned
            info = await admin.nc.jetstream().stream_info(f"KV_{subjects.registry_bucket}")
            assert info.config.deny_purge and not info.config.allow_rollup_hdrs and info.config.max_msg_size > 0
            assert info.config.subjects == [f"$KV.{subjects.registry_bucket}.>"]  # no republish, no extra subjects

    asyncio.run(main())


def test_a_key_writes_only_its_own_registry_entry_and_cannot_wipe_the_others(secured):
    bucket = secured.subjects.registry_bucket

    async def entries(admin) -> set[str]:
        info = await admin.nc.jetstream().stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.>")
        return set(info.state.subjects or {})

    async def main():
        async with Client(secured, "admin") as admin, Client(secured, "decode-0") as decode, \
                Client(secured, "prefill-0") as prefill:
            before = await entries(admin)
            assert f"$KV.{bucket}.decode.decode-0" in before
            js = decode.nc.jetstream(timeout=5)
            own = f"$KV.{bucket}.decode.decode-0"
            info = ServiceInfo(instance_id="decode-0", role="decode", state="ready").encode()
            with pytest.raises(nats.js.errors.APIError):  # a rollup would wipe every other entry
                await js.publish(own, info, headers={"Nats-Rollup": "all"})
            with pytest.raises(nats.js.errors.APIError):  # values are bounded
                await js.publish(own, b"x" * (64 * 1024))
            for subject, attacker in [(f"$KV.{bucket}.decode.decode-1", decode),  # a second entry, a fake worker
                                      (f"$KV.{bucket}.decode.junk-7", decode),
                                      (f"$KV.{bucket}.decode.decode-0", prefill)]:  # another's entry, re-put
                await attacker.nc.publish(subject, info)
                assert await attacker.refused("publish", subject), subject
            assert await entries(admin) >= before  # nothing wiped, nothing added
            assert not (await entries(admin)) - before - {f"$KV.{bucket}.{ROLE_OF[i]}.{i}" for i in RUNNING}

    asyncio.run(main())


@pytest.mark.parametrize("instance, pattern", [
    ("decode-0", "{ns}.worker.*.generate"),  # requests (prompts) handed to every worker
    ("stage-0", "{ns}.worker.decode-0.generate"),  # another instance's requests
    ("prefill-0", "{ns}.prefill.prefill-1.offer"),
    ("kvstore-0", "{ns}.tokens.>"),  # other users' outputs
    ("decode-0", "_INBOX.>"),  # every instance's replies
    ("decode-0", "_INBOX.{ns}.decode.decode-1.>"),  # its own role's other instance's replies
    ("gateway-0", "{ns}.stats.*"),
])
def test_an_instance_listens_only_to_its_own_work(secured, instance, pattern):
    pattern = pattern.format(ns=secured.namespace)

    async def main():
        async with Client(secured, instance) as listener:
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


def test_no_worker_speaks_for_another_to_the_scheduler_or_a_decode_worker(secured):
    subjects = secured.subjects

    async def main():
        async with Client(secured, "admin") as admin, Client(secured, "decode-0") as decode, \
                Client(secured, "stage-0") as stage:
            scheduler_before = (await stats_of(admin, "scheduler-0")).details["rejected_messages"].get("forged", 0)
            decode_before = (await stats_of(admin, "decode-0")).details["rejected_messages"].get("forged", 0)
            # KV events "from prefill-0", under decode-0's name: the scheduler's index would route by them.
            lie = KVEvents(instance_id="prefill-0", role="prefill", boot_id="b", seq=0, snapshot=True,
                           stored=[b"\x01" * 16])
            await decode.nc.publish(sent_by(subjects.kv_events, "decode", "decode-0"), lie.encode())
            # A prefill result "from prefill-0" to decode-0, under stage-0's name.
            result = PrefillResult(request_id="r-" + uuid.uuid4().hex, ok=False, prefill_instance="prefill-0")
            await stage.nc.publish(sent_by(subjects.prefill_results("decode-0"), "prefill", "stage-0"),
                                   result.encode())
            await decode.nc.flush()
            await stage.nc.flush()

            async def counted():
                scheduler = (await stats_of(admin, "scheduler-0")).details["rejected_messages"].get("forged", 0)
                worker = (await stats_of(admin, "decode-0")).details["rejected_messages"].get("forged", 0)
                return scheduler > scheduler_before and worker > decode_before

            deadline = asyncio.get_running_loop().time() + 10
            while not await counted():
                assert asyncio.get_running_loop().time() < deadline, "the forged reports were not dropped"
                await asyncio.sleep(0.1)
            # And a worker cannot sign as another at all.
            other = sent_by(subjects.worker_load, "prefill", "prefill-0")
            await decode.nc.publish(other, b"x")
            assert await decode.refused("publish", other)

    asyncio.run(main())


def test_the_secured_deployment_serves_and_no_service_is_refused(secured):
    response = httpx.post(f"{secured.run.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 4})
    assert response.status_code == 200, response.text
    logs = sorted((secured.run.run_dir / "logs").glob("*.log"))
    assert {f"{i}.log" for i in RUNNING} <= {p.name for p in logs}
    for path in logs:
        assert "nats refused" not in path.read_text(), path.name
    argv = {s["instance_id"]: s["argv"] for s in json.loads(
        (secured.run.run_dir / "deployment.json").read_text())["services"]}
    for instance, args in argv.items():  # each holds its own key, no other
        assert args[args.index("--nats-creds") + 1] == str(creds_path(secured.creds, instance))
    assert all(p.stat().st_mode & 0o077 == 0 for p in [secured.creds, *secured.creds.iterdir()] if p.name != "public")


def test_doctor_checks_the_operators_server_with_the_admin_key_and_is_refused_without(secured, tmp_path):
    doctor = [sys.executable, "-m", "services.cli.main", "doctor", "--nats", secured.nats_url, "--json", "--run-dir",
              str(tmp_path / "doctor")]
    result = subprocess.run([*doctor, "--nats-creds", str(secured.creds / "admin.nk")], capture_output=True, text=True,
                            env=service_env(), cwd=ROOT, timeout=60)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["nats"]["status"] == "ok", checks["nats"]
    result = subprocess.run(doctor, capture_output=True, text=True, env=service_env(), cwd=ROOT, timeout=60)
    assert "Authorization Violation" in result.stdout  # without credentials, refused


def test_the_kv_store_serves_only_registered_workers_of_the_model_they_name(secured):
    subjects = secured.subjects
    lookup = subjects.kvstore("kvstore-0", "lookup")

    async def main():
        async with Client(secured, "admin") as admin, Client(secured, "stage-0") as stage, \
                Client(secured, "decode-0") as decode, Client(secured, "gateway-0") as gateway:
            model = (await stats_of(admin, "decode-0")).kv_fingerprint
            assert model

            async def ask(client: Client, role: str, fingerprint: bytes) -> KVStoreReply:
                reply = await client.nc.request(sent_by(lookup, role, client.instance_id), KVStoreLookup(
                    hashes=[b"\x00" * 16], model_fingerprint=fingerprint).encode(), timeout=5)
                return KVStoreReply.decode(reply.data)

            stranger = await ask(stage, "decode", model)  # an admitted key, but no model worker of the deployment
            assert not stranger.ok and "not a registered model worker" in stranger.error
            other_model = await ask(decode, "decode", b"\x01" * 16)
            assert not other_model.ok and "another model" in other_model.error
            assert (await ask(decode, "decode", model)).ok  # control: the worker, naming its own model
            await gateway.nc.publish(sent_by(lookup, "gateway", "gateway-0"), b"")
            assert await gateway.refused("publish", sent_by(lookup, "gateway", "gateway-0"))

    asyncio.run(main())


def test_an_answer_goes_only_to_the_askers_inbox_not_where_the_request_points(secured):
    """The confused deputy: a request whose reply subject is another's registry entry or a signed token subject
    would have the answer published there under the answerer's name."""
    subjects = secured.subjects
    bucket = subjects.registry_bucket

    async def main():
        async with Client(secured, "admin") as watcher, Client(secured, "decode-0") as decode:
            seen = await subjects_seen(watcher, ">")
            model = (await stats_of(watcher, "decode-0")).kv_fingerprint
            lookup = sent_by(subjects.kvstore("kvstore-0", "lookup"), "decode", "decode-0")
            body = KVStoreLookup(hashes=[b"\x00" * 16], model_fingerprint=model).encode()
            targets = [f"$KV.{bucket}.scheduler.scheduler-0",
                       sent_by(subjects.tokens("gateway-0", "r-" + uuid.uuid4().hex), "decode", "decode-1")]
            for target in targets:
                await decode.nc.publish(lookup, body, reply=target)
            control = await decode.nc.request(lookup, body, timeout=5)  # answered after those, in order
            assert KVStoreReply.decode(control.data).ok
            await eventually(lambda: control.subject in seen, what="the watcher never saw the control's answer")
            assert not set(targets) & set(seen)
            entry = await (await watcher.nc.jetstream().key_value(bucket)).get("scheduler.scheduler-0")
            assert ServiceInfo.decode(entry.value).instance_id == "scheduler-0"  # still the scheduler's own

    asyncio.run(main())


def test_a_stage_sends_steps_only_along_its_pipeline(secured):
    """nats-auth's default pipeline is stage-0 (head) -> stage-1: stage-1 reaches its head, not another stage."""
    subjects = secured.subjects

    async def main():
        async with Client(secured, "admin") as watcher, Client(secured, "stage-1") as stage:
            seen = await subjects_seen(watcher, f"{subjects.namespace}.stage.>")
            for elsewhere in (subjects.stage_activations("stage-7"), subjects.stage_activations("decode-0"),
                              subjects.stage_tickets("stage-7")):
                await stage.nc.publish(elsewhere, b"x")
                assert await stage.refused("publish", elsewhere), elsewhere
            allowed = subjects.stage_activations("stage-0")  # control: logits back to its head
            await stage.nc.publish(allowed, b"x")
            await eventually(lambda: allowed in seen, what="the watcher never saw the allowed step")
            assert seen == [allowed]

    asyncio.run(main())


def test_no_key_but_the_admins_may_switch_a_workers_role(secured):
    """A role switch comes on the worker's own control subject (`up --role-switch`): every instance's key is refused
    there, the admin's gets through (heard by an admin watcher); no worker's key may take another's switches."""
    subjects = secured.subjects
    target = subjects.role_switch("decode-0")

    async def attack():
        async with Client(secured, "admin") as watcher:
            seen = await subjects_seen(watcher, target)
            for instance_id in RUNNING:
                async with Client(secured, instance_id) as attacker:
                    await attacker.nc.publish(target, RoleSwitch(to="prefill").encode())
                    assert await attacker.refused("publish", target), instance_id
            async with Client(secured, "prefill-0") as other:
                await other.nc.subscribe(target)
                assert await other.refused("subscription", target)
            await watcher.nc.publish(target, b"not a switch")  # control: the admin's publish goes through
            await eventually(lambda: seen == [target], timeout_s=5, what="the admin's publish")

    asyncio.run(attack())
