"""Two models on one fabric, isolated by the bus itself (issue 38): a real nats-server with the authorization config
`splitserve up` writes for a deployment of two models. A worker or scheduler of model B (namespace dep-b) can neither
send into nor listen to model A's subjects (namespace dep); the gateway works in both; no service key may tell the
gateway to serve a model. Each refusal is checked by the server's answer and by what an admin watcher saw."""

import asyncio
import subprocess

import nats
import pytest

from contracts import ServeModel, Subjects
from services.launcher.nats_auth import ADMIN_INSTANCE, Instance, creds_path, ensure_credentials, write_server_config
from shared.bus.permissions import inbox_prefix
from support.processes import find_nats_server, free_port, jetstream_ready
from support.waiting import eventually, server_has, wait_until

A, B = Subjects("dep"), Subjects("dep-b")
INSTANCES = [Instance("gateway", "gateway-0", ("dep", "dep-b")), Instance("decode", "decode-0", ("dep",)),
             Instance("scheduler", "scheduler-0", ("dep",)), Instance("decode", "m1-decode-0", ("dep-b",)),
             Instance("scheduler", "m1-scheduler-0", ("dep-b",))]
ROLE = {i.instance_id: (i.role, i.namespaces[0]) for i in INSTANCES} | {"admin": ("admin", "dep")}


@pytest.fixture(scope="module")
def bus(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-models")
    keys = ensure_credentials(root / "creds", [*INSTANCES, ADMIN_INSTANCE])
    config = write_server_config(root / "nats.conf", keys, "dep")
    port = free_port()
    server = subprocess.Popen([find_nats_server(), "--jetstream", "--config", str(config), "--addr", "127.0.0.1",
                               "--port", str(port), "--store_dir", str(root / "js")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: jetstream_ready(port), 10, "the nats-server never listened", poll_s=0.05)
        yield f"nats://127.0.0.1:{port}", root / "creds"
    finally:
        server.terminate()
        server.wait(timeout=10)


class As:
    """One connection holding one instance's key; `errors`: what the server refused it."""

    def __init__(self, bus, instance_id: str):
        self.url, self.creds = bus
        self.instance_id, self.errors, self.seen = instance_id, [], []

    async def __aenter__(self):
        async def on_error(exc):
            self.errors.append(str(exc).lower())

        role, namespace = ROLE[self.instance_id]
        self.nc = await nats.connect(self.url, error_cb=on_error, allow_reconnect=False,
                                     nkeys_seed=str(creds_path(self.creds, self.instance_id)),
                                     inbox_prefix=inbox_prefix(namespace, role, self.instance_id))
        return self

    async def __aexit__(self, *exc):
        await self.nc.close()

    async def hear(self, subject: str) -> None:
        async def on_message(msg):
            self.seen.append(msg.subject)

        await self.nc.subscribe(subject, cb=on_message)
        await server_has(self.nc)

    async def refused(self, what: str, subject: str) -> bool:
        wanted = f'permissions violation for {what} to "{subject}"'.lower()
        try:
            await eventually(lambda: any(wanted in e for e in self.errors), timeout_s=5, what=wanted)
        except AssertionError:
            return False
        return True


def test_a_worker_of_model_b_neither_sends_into_nor_hears_model_a(bus):
    forged = A.tokens("gateway-0", "r1") + ".decode.m1-decode-0"

    async def attack():
        async with As(bus, "admin") as watcher, As(bus, "m1-decode-0") as b_worker:
            await watcher.hear(f"{A.namespace}.>")
            for subject in (forged, A.submit, f"{A.kv_events}.decode.m1-decode-0", A.cancel):
                await b_worker.nc.publish(subject, b"x")
                assert await b_worker.refused("publish", subject), subject
            for subject in (A.worker_generate("decode-0"), A.worker_generate("m1-decode-0"), A.cancel):
                await b_worker.nc.subscribe(subject)
                assert await b_worker.refused("subscription", subject), subject
            await watcher.nc.publish(A.cancel, b"control")  # the watcher hears what gets through
            await eventually(lambda: A.cancel in watcher.seen, timeout_s=5, what="the watcher's own message")
            assert watcher.seen == [A.cancel]  # nothing of B's worker reached model A

    asyncio.run(attack())


def test_a_scheduler_of_model_b_takes_no_load_reports_of_model_a(bus):
    async def attack():
        async with As(bus, "m1-scheduler-0") as b_scheduler:
            await b_scheduler.nc.subscribe(f"{A.kv_events}.*.*")
            assert await b_scheduler.refused("subscription", f"{A.kv_events}.*.*")
            await b_scheduler.nc.publish(A.worker_generate("decode-0"), b"x")
            assert await b_scheduler.refused("publish", A.worker_generate("decode-0"))

    asyncio.run(attack())


def test_the_gateway_works_in_both_namespaces_and_b_answers_it_in_b(bus):
    async def serve():
        async with As(bus, "gateway-0") as gateway, As(bus, "m1-decode-0") as b_worker, \
                As(bus, "decode-0") as a_worker:
            for subjects in (A, B):
                await gateway.hear(subjects.tokens_wildcard("gateway-0"))
            await b_worker.nc.publish(B.tokens("gateway-0", "r1") + ".decode.m1-decode-0", b"b")
            await a_worker.nc.publish(A.tokens("gateway-0", "r2") + ".decode.decode-0", b"a")
            await eventually(lambda: len(gateway.seen) == 2, timeout_s=5, what="both models' tokens")
            await gateway.nc.publish(B.submit, b"x")
            await server_has(gateway.nc)
            assert not gateway.errors and not b_worker.errors and not a_worker.errors

    asyncio.run(serve())


def test_no_service_key_tells_the_gateway_to_serve_a_model(bus):
    target = A.gateway_models("gateway-0")
    message = ServeModel(served_name="evil", serve=True, model="/tmp/x", namespace="dep-b").encode()

    async def attack():
        async with As(bus, "admin") as watcher:
            await watcher.hear(target)
            for instance_id in ("m1-decode-0", "m1-scheduler-0", "decode-0", "gateway-0"):
                async with As(bus, instance_id) as attacker:
                    await attacker.nc.publish(target, message)
                    assert await attacker.refused("publish", target), instance_id
            await watcher.nc.publish(target, b"the operator's")  # control: the admin's goes through
            await eventually(lambda: watcher.seen == [target], timeout_s=5, what="the admin's publish")

    asyncio.run(attack())
