"""Calls to a launcher's control API (`services.launcher.control_socket`) over its Unix socket."""

from __future__ import annotations

import errno
import http.client
import json
import socket


class ControlUnavailable(RuntimeError):
    """Nothing answers on the socket, or this user may not connect to it."""

    def __init__(self, message: str, not_permitted: bool = False) -> None:
        super().__init__(message)
        self.not_permitted = not_permitted


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def call(path: str, method: str, route: str, body: object = None, timeout_s: float = 30.0) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of one call; ControlUnavailable when it cannot be made."""
    conn = _UnixConnection(path, timeout_s)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, route, body=data, headers={"Content-Type": "application/json"} if data else {})
        response = conn.getresponse()
        text = response.read()
    except PermissionError:
        raise ControlUnavailable(f"not permitted to connect to {path} (only the deployment's user or root may)",
                                 not_permitted=True) from None
    except (FileNotFoundError, ConnectionRefusedError):
        raise ControlUnavailable(f"nothing answers on {path}") from None
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
            raise ControlUnavailable(f"nothing answers on {path}") from None
        raise ControlUnavailable(f"the control call on {path} failed: {exc}") from None
    except http.client.HTTPException as exc:
        raise ControlUnavailable(f"the control call on {path} failed: {exc!r}") from None
    finally:
        conn.close()
    try:
        answer = json.loads(text)
    except ValueError:
        answer = {"error": text.decode(errors="replace")}
    return response.status, answer if isinstance(answer, dict) else {"answer": answer}
