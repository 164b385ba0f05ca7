"""Where a side channel listens and what it advertises: its own flags, else --advertise-host, else the address
that routes to NATS."""

import pytest

from services.common.advertise import route_address, side_channel_addresses


def never() -> str:
    raise AssertionError("the route to NATS was looked up although an address was given")


@pytest.mark.parametrize("listen, advertise, advertise_host, expected", [
    (None, None, "10.1.2.3", ("10.1.2.3", "10.1.2.3")),     # --advertise-host: bound and advertised
    (None, "decode-0", "10.1.2.3", ("decode-0", "decode-0")),  # the channel's own advertise wins
    ("0.0.0.0", "decode-0", None, ("0.0.0.0", "decode-0")),  # compose: every interface, a service name
    ("0.0.0.0", None, "10.1.2.3", ("0.0.0.0", "10.1.2.3")),  # every interface, the host's address advertised
    ("127.0.0.1", None, "10.1.2.3", ("127.0.0.1", None)),     # a given listen address is its own advertise
])
def test_given_addresses_win_in_order(listen, advertise, advertise_host, expected):
    assert side_channel_addresses(listen, advertise, advertise_host, never) == expected


def test_without_any_the_address_toward_nats_is_bound_and_advertised():
    assert side_channel_addresses(None, None, None, lambda: "10.9.8.7") == ("10.9.8.7", "10.9.8.7")


def test_the_route_to_a_local_nats_is_loopback():
    assert route_address("nats://127.0.0.1:4222") == "127.0.0.1"
    assert route_address("nats://127.0.0.1:4222,nats://10.255.255.1:4222") == "127.0.0.1"  # the first server's
