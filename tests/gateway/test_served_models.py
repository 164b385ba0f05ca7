"""Which models a gateway serves, as settings and as the operator's changes (pure; tests/services/test_two_models.py
serves two for real): `--also-serve NAME=MODEL@NAMESPACE` parsed, checked and written back as `up` renders it, and
the `ServeModel` changes refused."""

import pytest

from contracts import ServeModel
from services.common.settings import SettingsError, settings_from, to_flags
from services.gateway.__main__ import build_parser
from services.gateway.also_serve import AlsoServe, parse_also_serve
from services.gateway.model_changes import change_refused
from services.gateway.settings import GatewayServiceSettings


def settings(*argv: str, environ=None) -> GatewayServiceSettings:
    return settings_from(GatewayServiceSettings, build_parser().parse_args(["--instance-id", "g", *argv]),
                         environ=environ or {})


def test_name_splits_at_the_first_equals_and_namespace_at_the_last_at():
    assert parse_also_serve("b=/models/x=1@v2@ns-b") == AlsoServe("b", "/models/x=1@v2", "ns-b")
    assert str(parse_also_serve("b=qwen@ns-b")) == "b=qwen@ns-b"
    for bad in ("b", "b=@ns", "=m@ns", "b=m", "b=m@", "b=m@n.s", "b=m@n*"):
        with pytest.raises(ValueError):
            parse_also_serve(bad)


def test_also_serve_round_trips_through_the_flags_up_renders_and_the_variable():
    given = settings("--served-model-name", "a", "--also-serve", "b=/m/b@ns-b", "--also-serve", "c=smollm2@ns-c")
    assert given.also_serve == (AlsoServe("b", "/m/b", "ns-b"), AlsoServe("c", "smollm2", "ns-c"))
    flags = to_flags(given)
    assert flags[flags.index("--also-serve"):] == ("--also-serve", "b=/m/b@ns-b", "--also-serve", "c=smollm2@ns-c")
    assert settings(*flags[2:]) == given
    assert settings(environ={"SPLITSERVE_ALSO_SERVE": "b=/m/b@ns-b,c=smollm2@ns-c"}).also_serve == given.also_serve
    assert settings().also_serve == () and "--also-serve" not in to_flags(settings())


@pytest.mark.parametrize("argv, said", [
    (("--served-model-name", "a", "--also-serve", "a=/m@ns-b"), "'a' is given twice"),
    (("--also-serve", "b=/m@ns-b", "--also-serve", "b=/n@ns-c"), "'b' is given twice"),
    (("--also-serve", "b=/m@ns-b", "--also-serve", "c=/n@ns-b"), "namespace 'ns-b' of 'c' is another model's"),
    (("--namespace", "ns", "--also-serve", "b=/m@ns"), "namespace 'ns' of 'b' is another model's"),
    (("--also-serve", "b=/m@n.s"), "namespace 'n.s' may only contain"),
])
def test_two_models_may_not_share_a_name_or_a_namespace(argv, said):
    with pytest.raises(SettingsError, match=said):
        settings(*argv)


def test_the_changes_a_gateway_refuses():
    served, namespaces = ["a", "b"], {"ns", "ns-b"}

    def code(**fields):
        refused = change_refused(ServeModel(**fields), served, namespaces)
        return refused and refused[0]

    assert code(served_name="b", serve=False) is None
    assert code(served_name="c", serve=False) == "unknown_model"
    assert change_refused(ServeModel(served_name="a", serve=False), ["a"], {"ns"})[0] == "last_model"
    assert code(served_name="c", serve=True, model="/m", namespace="ns-c") is None
    assert code(served_name="b", serve=True, model="/m", namespace="ns-c") == "already_served"
    assert code(served_name="c", serve=True, model="/m", namespace="ns-b") == "failed"  # another model's pools
    assert code(served_name="c", serve=True, model="", namespace="ns-c") == "failed"
    assert code(served_name="c", serve=True, model="/m", namespace="ns.c") == "failed"
