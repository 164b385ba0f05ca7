"""The port a test, a benchmark or `splitserve up` picks for a server: outside the kernel's ephemeral range, so a
socket the kernel numbers while that server starts (another service's listener on port 0, an outgoing
connection) cannot take it first."""

import socket

import pytest

from services.common import free_port as ports
from support.processes import start_service, wait_for_http


def test_the_spans_outside_the_ephemeral_range():
    assert ports.ports_outside((32768, 60999)) == [range(10000, 32768), range(61000, 65536)]
    assert ports.ports_outside((10000, 65535)) == []
    assert ports.ports_outside((1024, 40000)) == [range(40001, 65536)]
    assert ports.ports_outside((20000, 65535)) == [range(10000, 20000)]


def test_the_kernels_range_is_read_and_a_missing_file_means_linuxs_default(tmp_path):
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ports.ephemeral_range(tmp_path / "range") == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.LINUX_EPHEMERAL_RANGE
    (tmp_path / "garbled").write_text("forty\n")
    assert ports.ephemeral_range(tmp_path / "garbled") == ports.LINUX_EPHEMERAL_RANGE


def test_a_picked_port_is_outside_the_ephemeral_range_and_a_server_can_listen_on_it():
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)


def test_a_port_someone_listens_on_is_not_free_and_with_no_room_outside_the_kernel_picks(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert not ports.port_free("127.0.0.1", port)
        # Every port outside the range is this one: every try finds it taken, so the kernel chooses.
        monkeypatch.setattr(ports, "ports_outside", lambda ephemeral: [range(port, port + 1)])
        low, high = ports.ephemeral_range()
        assert low <= ports.free_port(attempts=5) <= high
    assert ports.port_free("127.0.0.1", port)


def test_a_service_that_exits_before_it_is_ready_is_reported_with_the_end_of_its_log(tmp_path):
    proc = start_service("scheduler", ["--instance-id", "s-0", "--no-such-flag"], tmp_path)
    with pytest.raises(RuntimeError) as raised:
        wait_for_http(f"http://127.0.0.1:{ports.free_port()}/ready", 60, [proc])
    assert "exited with 2 before http://127.0.0.1:" in str(raised.value)
    assert "unrecognized arguments: --no-such-flag" in str(raised.value)
