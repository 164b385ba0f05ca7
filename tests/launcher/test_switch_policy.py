"""`splitserve switch`'s checks, and which workers each pool plans once some have switched
(`services.launcher.switch_policy`); the control API's refusals (`services.launcher.switcher`)."""

import pytest

from services.launcher.scale_policy import ScaleError
from services.launcher.switch_policy import check_switch, planned_names

ROLES = {"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill"}


def check(body, roles=ROLES, retiring=(), topology="disagg", prefill_pipeline=False, role_switch=True):
    return check_switch(body, topology=topology, prefill_pipeline=prefill_pipeline, role_switch=role_switch,
                        roles=roles, retiring=retiring)


def test_a_switch_of_a_worker_whose_pool_keeps_one_goes_ahead():
    assert check({"instance": "decode-1", "to": "prefill"}) == ("decode-1", "prefill")


@pytest.mark.parametrize("body, kwargs, says", [
    ({"instance": "decode-9", "to": "prefill"}, {}, "no running decode or prefill worker is named 'decode-9'"),
    ({"instance": "decode-1", "to": "decode"}, {}, "decode-1 is decode already"),
    ({"instance": "prefill-0", "to": "decode"}, {}, "the last prefill worker: a pool keeps at least 1"),
    ({"instance": "decode-1", "to": "prefill"}, {"retiring": ["decode-0"]}, "the last decode worker"),
    ({"instance": "decode-1", "to": "prefill"}, {"retiring": ["decode-1"]}, "decode-1 is retiring"),
    ({"instance": "decode-1", "to": "prefill"}, {"topology": "colocated"}, "only a disagg deployment"),
    ({"instance": "decode-1", "to": "prefill"}, {"prefill_pipeline": True}, "only a disagg deployment"),
    ({"instance": "decode-1", "to": "prefill"}, {"role_switch": False}, "up --role-switch"),
    ({"instance": "decode-1", "to": "stage"}, {}, "not 'stage'"),
    ({"instance": "decode-1"}, {}, 'the body is {"instance"'),
    (["decode-1"], {}, 'the body is {"instance"'),
])
def test_a_switch_is_refused_clearly(body, kwargs, says):
    with pytest.raises(ScaleError, match=None) as refused:
        check(body, **kwargs)
    assert says in str(refused.value)


PLAN = {"decode": ["decode-0", "decode-1", "decode-2", "decode-3"],
        "prefill": ["prefill-0", "prefill-1", "prefill-2"]}


@pytest.mark.parametrize("desired, roles, planned", [
    # No switch: as by name (start the next, retire the last, a retiring name holds its place).
    ({"decode": 2, "prefill": 1}, {"decode-0": "decode", "prefill-0": "prefill"}, ["decode-0", "decode-1", "prefill-0"]),
    ({"decode": 1, "prefill": 1}, ROLES, ["decode-0", "prefill-0"]),
    # decode-1 switched to prefill: counted there, neither retired nor started again.
    ({"decode": 1, "prefill": 2}, {"decode-0": "decode", "decode-1": "prefill", "prefill-0": "prefill"},
     ["decode-0", "prefill-0", "decode-1"]),
    # ...then decode=2: a new name, not decode-1 (it is a prefill worker now).
    ({"decode": 2, "prefill": 2}, {"decode-0": "decode", "decode-1": "prefill", "prefill-0": "prefill"},
     ["decode-0", "decode-2", "prefill-0", "decode-1"]),
    # ...or prefill=1: the switched worker leaves first.
    ({"decode": 1, "prefill": 1}, {"decode-0": "decode", "decode-1": "prefill", "prefill-0": "prefill"},
     ["decode-0", "prefill-0"]),
])
def test_pools_plan_by_each_workers_role_now(desired, roles, planned):
    assert planned_names(desired, PLAN, roles) == planned


class _Scaler:
    """What `Switches.handle` reads of the scaler and its launcher."""

    def __init__(self, role_switch=True, admin=object()):
        from types import SimpleNamespace

        self.launcher = SimpleNamespace(
            options=SimpleNamespace(topology="disagg", prefill_stages=None, role_switch=role_switch, nats_auth=True,
                                    namespace="ns"),
            admin=admin, resolved=None)

    def view(self):
        return {"retiring": [], "services": {n: {"role": r, "pid": 1} for n, r in ROLES.items()}}


@pytest.mark.parametrize("scaler, body, status, says", [
    (_Scaler(), {"instance": "nope", "to": "prefill"}, 400, "no running"),
    (_Scaler(), {"instance": "decode-1", "to": "decode"}, 400, "already"),
    (_Scaler(), {"instance": "prefill-0", "to": "decode"}, 400, "a pool keeps at least 1"),
    (_Scaler(role_switch=False), {"instance": "decode-1", "to": "prefill"}, 400, "not enabled"),
    (_Scaler(), {"instance": "decode-1", "to": "prefill", "drain_s": -1}, 400, "drain_s"),
    (_Scaler(admin=None), {"instance": "decode-1", "to": "prefill"}, 409, "admin"),
])
def test_the_control_api_refuses_a_bad_switch_before_any_worker_hears_of_it(scaler, body, status, says):
    from services.launcher.switcher import Switches

    answer = Switches(scaler).handle(body)
    assert answer[0] == status and says in answer[1]["error"]


def test_nats_auth_grants_the_switchable_permissions_with_role_switch_and_keeps_the_choice(tmp_path):
    """For a --nats server: `nats-auth --role-switch` lets a decode instance take switches and speak as prefill;
    a later run without the flag keeps the choice; --no-role-switch takes it back."""
    import json

    from services.cli import main as cli_main

    def decode_may() -> tuple[bool, bool]:
        users = json.loads((tmp_path / "nats-auth.conf").read_text())["authorization"]["users"]
        perms = next(u["permissions"] for u in users
                     if "ns.load.decode.decode-0" in u["permissions"]["publish"]["allow"])
        subscribe, publish = perms["subscribe"]["allow"], perms["publish"]["allow"]
        return "ns.control.decode-0.switch" in subscribe, "ns.load.prefill.decode-0" in publish

    args = ["nats-auth", str(tmp_path), "--namespace", "ns", "--instance", "decode:decode-0"]
    assert cli_main.main(args) == 0
    assert decode_may() == (False, False)
    assert cli_main.main([*args, "--role-switch"]) == 0
    assert decode_may() == (True, True)
    assert cli_main.main(args) == 0  # kept
    assert decode_may() == (True, True)
    assert cli_main.main([*args, "--no-role-switch"]) == 0
    assert decode_may() == (False, False)
