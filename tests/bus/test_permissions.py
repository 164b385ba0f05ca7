"""The per-instance permission table (pure); the server enforcing it is tests/security/test_bus_identity.py."""

import pytest

from contracts import Subjects, model_namespace, sent_by
from shared.bus.permissions import ADMIN, ROLES, Pipeline, inbox_prefix, instance_permissions, merged

S = Subjects("ns")
# One instance of each role, and a second of each (named "-1"): what one may do, the other may not do as it.
INSTANCES = [(role, f"{role}-{n}") for role in ROLES for n in (0, 1)]


def allows(patterns, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    tokens = subject.split(".")
    for pattern in patterns:
        parts = pattern.split(".")
        if parts[-1] == ">" and len(tokens) >= len(parts) and all(p in ("*", t) for p, t in zip(parts[:-1], tokens)):
            return True
        if len(parts) == len(tokens) and all(p in ("*", t) for p, t in zip(parts, tokens)):
            return True
    return False


def who_publishes(subject: str) -> set[str]:
    return {iid for role, iid in INSTANCES if allows(instance_permissions(role, iid, S).publish, subject)}


def who_subscribes(subject: str) -> set[str]:
    return {iid for role, iid in INSTANCES if allows(instance_permissions(role, iid, S).subscribe, subject)}


def test_only_admin_holds_everything():
    assert instance_permissions(ADMIN, "admin", S).publish == (">",)
    for role, iid in INSTANCES:
        permissions = instance_permissions(role, iid, S)
        assert ">" not in permissions.publish and ">" not in permissions.subscribe
        assert not allows(permissions.subscribe, "other.tokens.gateway-0.r1.decode.decode-0")  # another deployment


def test_each_instance_reads_only_its_own_inbox():
    for role, iid in INSTANCES:
        subscribe = instance_permissions(role, iid, S).subscribe
        for other_role, other in INSTANCES:
            assert allows(subscribe, f"{inbox_prefix('ns', other_role, other)}.abc.1") == (other == iid), (iid, other)


@pytest.mark.parametrize("asker, answerers", [
    ("gateway", {iid for _, iid in INSTANCES}),  # its stats requests: everyone answers
    ("admin", {iid for _, iid in INSTANCES}),  # the operator's too
    ("scheduler", {"decode-0", "decode-1", "stage-0", "stage-1"}),  # its handoffs
    ("decode", {"prefill-0", "prefill-1", "kvstore-0", "kvstore-1", "stage-0", "stage-1"}),  # offers, the kv-store
    ("prefill", {"kvstore-0", "kvstore-1"}),
    ("kvstore", set()),  # it asks nobody
])
def test_answers_go_only_into_the_inboxes_of_those_whose_requests_an_instance_serves(asker, answerers):
    """Not wherever a request's reply subject says: NATS's allow_responses would let an asker have the answer
    published on any subject (another's registry entry, a signed token subject) under the answerer's name."""
    assert who_publishes(f"{inbox_prefix('ns', asker, f'{asker}-0')}.nuid.1") == answerers
    for role, iid in INSTANCES:
        assert not instance_permissions(role, iid, S).allow_responses


@pytest.mark.parametrize("subject, publishers", [
    (S.submit, {"gateway-0", "gateway-1"}),
    # A request's events: each worker only under its own name (a stage as any pool's worker), the scheduler as itself.
    (sent_by(S.tokens("gateway-0", "r1"), "decode", "decode-0"), {"decode-0"}),
    (sent_by(S.tokens("gateway-0", "r1"), "decode", "stage-1"), {"stage-1"}),
    (sent_by(S.tokens("gateway-0", "r1"), "scheduler", "scheduler-0"), {"scheduler-0"}),
    (sent_by(S.tokens("gateway-0", "r1"), "scheduler", "decode-0"), set()),
    (S.tokens("gateway-0", "r1"), set()),  # unsigned: nobody
    (sent_by(S.prefill_results("decode-0"), "prefill", "prefill-1"), {"prefill-1"}),
    (sent_by(S.kv_events, "decode", "decode-1"), {"decode-1"}),
    (sent_by(S.kv_events, "kvstore", "kvstore-0"), {"kvstore-0"}),
    (sent_by(S.worker_load, "prefill", "prefill-0"), {"prefill-0"}),
    (S.worker_generate("decode-0"), {"scheduler-0", "scheduler-1"}),
    (S.prefill_jobs, {"decode-0", "decode-1", "stage-0", "stage-1"}),
    ("$KV.ns-registry.decode.decode-0", {"decode-0"}),
    ("$KV.ns-registry.prefill.stage-0", {"stage-0"}),
    ("$KV.ns-registry.scheduler.decode-0", set()),
    ("$JS.API.CONSUMER.MSG.NEXT.ns-requests.scheduler", {"scheduler-0", "scheduler-1"}),
    ("$JS.API.STREAM.MSG.GET.ns-requests", set()),
])
def test_who_may_publish(subject, publishers):
    assert who_publishes(subject) == publishers


@pytest.mark.parametrize("verb", ["CREATE", "UPDATE", "DELETE", "PURGE"])
@pytest.mark.parametrize("stream", ["ns-requests", "ns-prefill", "KV_ns-registry"])
def test_no_service_changes_a_stream(verb, stream):
    assert who_publishes(f"$JS.API.STREAM.{verb}.{stream}") == set()
    assert who_publishes(f"$JS.API.CONSUMER.{verb}.{stream}.scheduler") == set()
    assert who_publishes(f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.prefill") == set()


@pytest.mark.parametrize("subject, readers", [
    (sent_by(S.tokens("gateway-0", "r1"), "decode", "decode-0"), {"gateway-0"}),
    (S.worker_generate("decode-0"), {"decode-0"}),
    (S.worker_generate("stage-1"), {"stage-1"}),
    (S.kvstore("kvstore-0", "get"), {"kvstore-0"}),
    (S.prefill_offer("prefill-0"), {"prefill-0"}),
    (sent_by(S.prefill_results("decode-1"), "prefill", "prefill-0"), {"decode-1"}),
    (S.stats("decode-0"), {"decode-0"}),
    (S.kv_snapshot("kvstore-1"), {"kvstore-1"}),
])
def test_who_may_subscribe(subject, readers):
    assert who_subscribes(subject) == readers


def test_an_unknown_role_or_a_bad_name_is_an_error():
    with pytest.raises(ValueError, match="unknown role"):
        instance_permissions("attacker", "x", S)
    with pytest.raises(ValueError, match="instance id"):
        instance_permissions("decode", "decode.*", S)


def test_a_stage_sends_steps_only_along_its_pipelines():
    """Head -> stage-1 -> stage-2 -> back to the head; another pipeline's stage, or a stage of none, reaches none
    of them."""
    pipelines = (Pipeline("head", ("stage-1", "stage-2")), Pipeline("other-head", ("other-1",)))

    def reaches(iid: str) -> set[tuple[str, str]]:
        publish = instance_permissions("stage", iid, S, pipelines).publish
        return {(to, what) for to in ("head", "stage-1", "stage-2", "other-head", "other-1", "lone")
                for what, subject in (("steps", S.stage_activations(to)), ("tickets", S.stage_tickets(to)),
                                      ("shipped", S.stage_shipped(to)))
                if allows(publish, subject)}

    assert reaches("head") == {("stage-1", "steps"), ("stage-1", "tickets")}
    assert reaches("stage-1") == {("stage-2", "steps"), ("stage-2", "tickets"), ("head", "steps"),
                                  ("head", "tickets"), ("head", "shipped")}
    assert reaches("stage-2") == {("head", "steps"), ("head", "tickets"), ("head", "shipped")}
    assert reaches("other-1") == {("other-head", "steps"), ("other-head", "tickets"), ("other-head", "shipped")}
    assert reaches("lone") == set()


def test_a_gateway_serving_two_models_reaches_both_namespaces_and_their_workers_only_their_own():
    """The launcher merges the gateway's permissions in each model's namespace into its one credential; each
    model's workers keep their namespace's alone."""
    first, second = Subjects("ns"), Subjects(model_namespace("ns", "model-b"))
    gateway = merged(*(instance_permissions("gateway", "gateway-0", s) for s in (first, second)))
    for s in (first, second):
        assert allows(gateway.subscribe, sent_by(s.tokens("gateway-0", "r1"), "decode", "decode-0"))
        assert allows(gateway.subscribe, f"{inbox_prefix(s.namespace, 'gateway', 'gateway-0')}.nuid.1")
        assert allows(gateway.publish, s.submit) and allows(gateway.publish, s.stats("decode-0"))
    assert allows(gateway.subscribe, first.gateway_models("gateway-0"))
    assert not allows(gateway.subscribe, first.tokens_wildcard("gateway-1"))  # still only its own streams
    worker = instance_permissions("decode", "decode-0", first)
    assert not allows(worker.publish, sent_by(second.tokens("gateway-0", "r1"), "decode", "decode-0"))
    assert not allows(worker.subscribe, second.worker_generate("decode-0"))
    assert not allows(worker.publish, second.prefill_jobs)
    assert not allows(worker.publish, f"$KV.{second.registry_bucket}.decode.decode-0")
    assert not allows(worker.subscribe, second.cancel)


def test_only_the_admin_may_change_a_gateways_models():
    assert who_publishes(S.gateway_models("gateway-0")) == set()
    assert who_subscribes(S.gateway_models("gateway-0")) == {"gateway-0"}
