"""How many copies of each stream and bucket a service asks for, by the cluster it finds; on a real cluster, a
default that never undoes another service's choice, and copies placed once the cluster can hold them."""

import asyncio

import pytest

from services.launcher.nats_server import EmbeddedNatsCluster, jetstream_answers
from shared.bus.connection import connect, drain
from nats.js.errors import APIError

from shared.bus.provision import ProvisionError, Replicas, ensure_stream, replicas_asked, replicas_for, settling
from shared.bus.registry import Registry


@pytest.mark.parametrize("requested, cluster_size, replicas", [
    (None, 1, 1),   # one server: one copy
    (None, 2, 1),   # two nodes cannot keep a quorum when one goes: no point in two copies by default
    (None, 3, 3),   # three: one may go
    (None, 5, 3),
    (1, 3, 1),      # asked for: as asked
    (2, 3, 2),
    (5, 5, 5),
])
def test_replicas_follow_the_cluster_unless_asked(requested, cluster_size, replicas):
    assert replicas_for(requested, cluster_size) == replicas


@pytest.mark.parametrize("requested, cluster_size, says", [
    (3, 1, "needs a NATS cluster of 3 nodes or more; this one has 1"),
    (0, 3, "must be 1 to 5"),
    (6, 7, "must be 1 to 5"),
])
def test_replicas_the_cluster_cannot_hold_are_refused_with_the_reason(requested, cluster_size, says):
    with pytest.raises(ProvisionError, match=says):
        replicas_for(requested, cluster_size)


class _Client:
    """What `replicas_asked` reads of a connection: the INFO its server sent (connect_urls: the cluster's nodes)."""

    def __init__(self, nodes: int):
        self._server_info = {"connect_urls": [f"10.0.0.{i}:4222" for i in range(nodes)] if nodes > 1 else []}


@pytest.mark.parametrize("requested, nodes_seen, replicas", [
    (None, 1, Replicas(1)),
    (None, 2, Replicas(1)),   # a cluster of 3 whose routes are still forming may show 2: a default, not a choice
    (None, 3, Replicas(3)),
    (3, 2, Replicas(3, chosen=True)),  # asked for: as asked, whatever this client saw (the servers judge)
    (1, 3, Replicas(1, chosen=True)),
])
def test_a_service_asks_for_what_it_was_told_else_a_default_by_the_nodes_it_sees(requested, nodes_seen, replicas):
    assert replicas_asked(requested, _Client(nodes_seen)) == replicas


def test_a_service_told_an_impossible_count_is_refused():
    with pytest.raises(ProvisionError, match="must be 1 to 5"):
        replicas_asked(0, _Client(3))


STREAM = dict(subjects=["jobs.>"], retention="workqueue", storage="file", max_msgs=100, max_bytes=1 << 20,
              max_age_s=60.0)


async def _on_cluster(url: str, work):
    nc = await connect(url, name="test")
    try:
        return await work(nc.jetstream(timeout=2.0))
    finally:
        await drain(nc, timeout_s=2.0)


@pytest.mark.timeout(120)
def test_a_default_count_creates_but_never_changes_and_a_chosen_one_does(tmp_path):
    with EmbeddedNatsCluster(tmp_path, 3) as cluster:
        cluster.start(jetstream_answers)

        async def work(js):
            await ensure_stream(js, name="JOBS", **STREAM, replicas=Replicas(3))
            # A service that saw the cluster half-formed: its default leaves the stream and the bucket as they are.
            registry = await Registry.open(js, "reg", replicas=Replicas(3))
            seen = await ensure_stream(js, name="JOBS", **STREAM, replicas=Replicas(1))
            await Registry.open(js, "reg", ttl_s=4.0, replicas=Replicas(1))
            bucket = (await registry.kv.status()).stream_info.config
            kept = (seen.config.num_replicas, bucket.num_replicas, bucket.max_age)
            # An operator's choice is applied.
            chosen = await ensure_stream(js, name="JOBS", **STREAM, replicas=Replicas(1, chosen=True))
            await Registry.open(js, "reg", replicas=Replicas(1, chosen=True))
            bucket = (await registry.kv.status()).stream_info.config
            return kept, (chosen.config.num_replicas, bucket.num_replicas)

        kept, chosen = asyncio.run(_on_cluster(cluster.url, work))
        assert kept == (3, 3, 4.0)  # (the TTL is no default: it is applied)
        assert chosen == (1, 1)


@pytest.mark.parametrize("code, err_code, settling_now", [
    (400, 10005, True),   # no peers to place the copies on: the meta leader has not heard of every node yet
    (503, 10008, True),   # JetStream temporarily unavailable
    (500, 10009, True),   # no leader to handle the request
    (400, 10058, False),  # a stream of that name with another config: waiting changes nothing
    (400, 10052, False),  # an invalid config
])
def test_only_a_cluster_forming_or_electing_is_waited_out(code, err_code, settling_now):
    with pytest.raises(APIError) as raised:  # the client's own parse of a JetStream API error reply
        APIError.from_error({"code": code, "err_code": err_code, "description": "refused"})
    assert settling(raised.value) is settling_now
