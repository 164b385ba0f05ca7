"""The launcher's control API: HTTP/1.1 with JSON bodies on a Unix-domain socket in the run directory.

Who may call it is the operator's credential: the socket file is 0600 (only the launcher's user can connect), and
each connection's peer is checked again with SO_PEERCRED (the launcher's own uid, or root). The standard library's
HTTP server is enough for a few routes and gives the handler its connection, which SO_PEERCRED needs. Requests are
served on their own threads; `handle(method, route, body)` must not touch what the launcher's main loop owns (it
hands work to it: see `services.launcher.scaler`).
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import struct
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path

SOCKET_NAME = "control.sock"
MAX_PATH = 100  # AF_UNIX paths are at most 107 bytes
MAX_BODY = 64 * 1024
TEMP_PREFIX = "splitserve-control-"

Handler = Callable[[str, str, object], tuple[int, dict]]


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def permitted(uid: int, own_uid: int) -> bool:
    """Only the launcher's user, or root, operates the deployment."""
    return uid in (own_uid, 0)


def socket_path(run_dir: Path) -> Path:
    """RUN_DIR/control.sock, or, where that path is too long for a Unix socket, one in a private temp folder."""
    path = Path(run_dir).absolute() / SOCKET_NAME
    if len(os.fsencode(path)) <= MAX_PATH:
        return path
    return Path(tempfile.mkdtemp(prefix=TEMP_PREFIX)) / SOCKET_NAME


class _Request(BaseHTTPRequestHandler):
    server: ControlServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the standard library's names)
        self._answer(None)

    def do_DELETE(self) -> None:  # noqa: N802
        self._answer(None)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._send(413, {"error": f"a request body is at most {MAX_BODY} bytes"})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except ValueError:
            self._send(400, {"error": "the body is not JSON"})
            return
        self._answer(body)

    def _answer(self, body: object) -> None:
        uid = peer_uid(self.connection)
        if not permitted(uid, self.server.own_uid):
            self._send(403, {"error": f"not permitted: uid {uid} is not the deployment's operator "
                                      f"(uid {self.server.own_uid}, or root)"})
            return
        try:
            status, answer = self.server.handle(self.command, self.path, body)
        except Exception as exc:  # an answer, never a dropped connection
            status, answer = 500, {"error": f"{type(exc).__name__}: {exc}"}
        self._send(status, answer)

    def _send(self, status: int, answer: dict) -> None:
        data = (json.dumps(answer) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (quiet: the launcher says what it does)
        pass


class ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: Path, handle: Handler) -> None:
        self.path = Path(path)
        self.handle = handle
        self.own_uid = os.getuid()
        self.path.unlink(missing_ok=True)  # a dead launcher's socket
        old_mask = os.umask(0o177)  # the socket is made 0600: no window in which others could connect
        try:
            super().__init__(str(self.path), _Request)
        finally:
            os.umask(old_mask)
        os.chmod(self.path, 0o600)
        self._thread: threading.Thread | None = None

    def start(self) -> ControlServer:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="control-api", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.path.unlink(missing_ok=True)
        if self.path.parent.name.startswith(TEMP_PREFIX):  # the private folder `socket_path` made
            self.path.parent.rmdir()
