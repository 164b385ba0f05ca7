"""Role epochs and switches: which messages a worker takes in which role and epoch, and which switches it starts
(`services.common.role_epoch`); the bus's word on who may switch it (`shared.bus.permissions`)."""

import fnmatch

import pytest

from contracts import Subjects
from services.common.role_epoch import epoch_refusal, switch_refusal
from shared.bus.permissions import ADMIN, ROLES, instance_permissions


@pytest.mark.parametrize("for_role, epoch, my_role, my_epoch, taken", [
    ("decode", 0, "decode", 0, True),
    ("decode", 2, "decode", 2, True),
    ("decode", None, "decode", 0, True),  # a sender that does not say: only a worker that never switched
    ("decode", None, "decode", 2, False),
    ("decode", 0, "decode", 2, False),  # routed before two switches (to prefill and back)
    ("decode", 1, "prefill", 1, False),  # the right epoch, the wrong role
    ("prefill", 0, "decode", 0, False),
    ("prefill", 1, "prefill", 1, True),
    ("prefill", 0, "prefill", 1, False),
])
def test_a_worker_takes_a_message_only_in_the_role_and_epoch_it_was_routed_under(for_role, epoch, my_role, my_epoch,
                                                                                   taken):
    assert (epoch_refusal(for_role, epoch, my_role, my_epoch) is None) == taken


@pytest.mark.parametrize("current, to, state, switchable, switching, code", [
    ("decode", "prefill", "ready", True, False, None),
    ("prefill", "decode", "waiting", True, False, None),
    ("decode", "prefill", "ready", False, False, "not_switchable"),
    ("decode", "stage", "ready", True, False, "unknown_role"),
    ("decode", "decode", "ready", True, False, "same_role"),
    ("decode", "prefill", "ready", True, True, "busy"),
    ("decode", "prefill", "draining", True, False, "busy"),
])
def test_which_switches_a_worker_starts(current, to, state, switchable, switching, code):
    refused = switch_refusal(current, to, state, switchable, switching)
    assert (refused[0] if refused else None) == code


def _allows(patterns, subject: str) -> bool:
    """NATS subject matching of `patterns` (`*` one token, `>` the rest), enough for these subjects."""
    def match(pattern: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        if p and p[-1] == ">":
            return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s))
        return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))
    return any(match(pattern) for pattern in patterns)


def test_only_the_admin_may_publish_a_switch_and_only_its_worker_may_take_it():
    subjects = Subjects("ns")
    switch = subjects.role_switch("decode-1")
    for role in ROLES:
        for switchable in (False, True):
            perms = instance_permissions(role, "decode-1", subjects, switchable=switchable)
            assert not _allows(perms.publish, switch), (role, switchable)
    assert _allows(instance_permissions(ADMIN, ADMIN, subjects).publish, switch)
    mine = instance_permissions("decode", "decode-1", subjects, switchable=True)
    other = instance_permissions("decode", "decode-0", subjects, switchable=True)
    assert _allows(mine.subscribe, switch) and not _allows(other.subscribe, switch)
    # Not switchable: no switch taken, and one role's permissions only.
    plain = instance_permissions("decode", "decode-1", subjects)
    assert not _allows(plain.subscribe, switch)
    assert not _allows(plain.subscribe, subjects.prefill_offer("decode-1"))
    assert not _allows(plain.publish, "$KV.ns-registry.prefill.decode-1")


def test_a_switchable_worker_holds_both_roles_under_its_own_name_only():
    subjects = Subjects("ns")
    perms = instance_permissions("decode", "decode-1", subjects, switchable=True)
    for subject in (subjects.worker_generate("decode-1"), subjects.prefill_offer("decode-1")):
        assert _allows(perms.subscribe, subject)
    assert _allows(perms.publish, "$KV.ns-registry.prefill.decode-1")
    assert _allows(perms.publish, "$KV.ns-registry.decode.decode-1")
    assert not _allows(perms.publish, "$KV.ns-registry.prefill.prefill-0")
    assert not _allows(perms.subscribe, subjects.prefill_offer("prefill-0"))
    assert _allows(perms.publish, "_INBOX.ns.decode.x.y")  # answering a decode worker's offer, as prefill
    # A kv-store or a gateway is never switchable, whatever is asked.
    assert instance_permissions("kvstore", "kvstore-0", subjects, switchable=True) == \
        instance_permissions("kvstore", "kvstore-0", subjects)
    assert fnmatch.fnmatch(subjects.role_switch("decode-1"), "ns.control.*.switch")
