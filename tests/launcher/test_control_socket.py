"""The launcher's control API on its Unix socket: JSON over HTTP for the operator, nobody else."""

import os
import stat
import tempfile
from pathlib import Path

import pytest
from peer import call_as_nobody

from services.launcher.control_client import ControlUnavailable, call
from services.launcher.control_socket import ControlServer, socket_path


@pytest.fixture
def open_dir():
    """A folder every user may enter (pytest's own are its user's alone)."""
    path = Path(tempfile.mkdtemp(prefix="control-test-"))
    path.chmod(0o755)
    yield path
    for item in path.iterdir():
        item.unlink()
    path.rmdir()


def echo(method, route, body):
    return 200, {"method": method, "route": route, "body": body}


def test_the_operator_calls_it_and_another_user_is_refused(open_dir):
    server = ControlServer(open_dir / "control.sock", echo).start()
    try:
        path = str(server.path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert call(path, "POST", "/v1/scale", {"decode": 2}) == (200, {"method": "POST", "route": "/v1/scale",
                                                                       "body": {"decode": 2}})
        # The file's mode keeps other users from connecting at all ...
        assert call_as_nobody(path) == "errno EACCES"
        # ... and were it opened up, the peer's uid (SO_PEERCRED) is checked on every call.
        os.chmod(path, 0o666)
        assert call_as_nobody(path).startswith("HTTP/1.1 403")
    finally:
        server.close()
    assert not server.path.exists()
    with pytest.raises(ControlUnavailable, match="nothing answers"):
        call(str(server.path), "GET", "/v1/deployment")


def test_a_run_dir_too_deep_for_a_unix_socket_gets_one_in_a_private_temp_folder(tmp_path):
    assert socket_path(tmp_path) == tmp_path / "control.sock"
    deep = tmp_path / ("d" * 120)
    path = socket_path(deep)
    assert path.name == "control.sock" and len(str(path)) < 100
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.parent.rmdir()
