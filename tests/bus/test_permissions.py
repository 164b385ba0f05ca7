"""The per-role permission table (pure); the server enforcing it is tests/services/test_bus_auth.py."""

import pytest

from contracts import Subjects
from shared.bus.permissions import ADMIN, ROLES, inbox_prefix, role_permissions

S = Subjects("ns")


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


def test_only_admin_holds_everything():
    assert role_permissions(ADMIN, S).publish == (">",)
    for role in ROLES:
        permissions = role_permissions(role, S)
        assert ">" not in permissions.publish and ">" not in permissions.subscribe
        assert not allows(permissions.subscribe, "other.tokens.gateway-0.r1")  # another deployment's subjects


def test_each_role_reads_only_its_own_inbox():
    for role in ROLES:
        subscribe = role_permissions(role, S).subscribe
        for other in ROLES:
            assert allows(subscribe, f"{inbox_prefix('ns', other)}.abc.1") == (other == role), (role, other)
        assert not any(p.startswith("_INBOX") for p in role_permissions(role, S).publish)


@pytest.mark.parametrize("subject, publishers", [
    (S.submit, {"gateway"}),
    (S.tokens("gateway-0", "r1"), {"scheduler", "decode", "stage"}),
    (S.worker_generate("decode-0"), {"scheduler"}),
    (S.prefill_jobs, {"decode", "stage"}),
    (S.kvstore("kvstore-0", "put"), {"decode", "prefill", "stage"}),
    ("$KV.ns-registry.decode.decode-0", {"decode", "stage"}),
    ("$JS.API.CONSUMER.MSG.NEXT.ns-requests.scheduler", {"scheduler"}),
    ("$JS.API.STREAM.MSG.GET.ns-requests", set()),
])
def test_who_may_publish(subject, publishers):
    assert {role for role in ROLES if allows(role_permissions(role, S).publish, subject)} == publishers


@pytest.mark.parametrize("subject, readers", [
    (S.tokens("gateway-0", "r1"), {"gateway"}),
    (S.worker_generate("decode-0"), {"decode", "stage"}),
    (S.kvstore("kvstore-0", "get"), {"kvstore"}),
    (S.prefill_offer("prefill-0"), {"prefill", "stage"}),
])
def test_who_may_subscribe(subject, readers):
    assert {role for role in ROLES if allows(role_permissions(role, S).subscribe, subject)} == readers


def test_an_unknown_role_is_an_error():
    with pytest.raises(ValueError, match="unknown role"):
        role_permissions("attacker", S)
