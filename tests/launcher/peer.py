"""A call on a Unix socket made by another user (nobody): what the operator's credential keeps out."""

import errno
import os
import pwd
import socket

NOBODY = pwd.getpwnam("nobody")


def call_as_nobody(path: str, timeout_s: float = 10.0, request: str = "GET /v1/deployment") -> str:
    """The HTTP status line `request` (a GET by default) on `path` gets as user nobody, or "errno NAME" when it
    cannot connect; from a forked child that becomes nobody (the tests run as root)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the socket module, then out
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(path)
                sock.sendall(f"{request} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n".encode())
                said = sock.recv(4096).split(b"\r\n", 1)[0]
            except OSError as exc:
                said = f"errno {errno.errorcode.get(exc.errno, exc.errno)}".encode()
            os.write(write_end, said)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        said = pipe.read()
    os.waitpid(pid, 0)
    return said.decode(errors="replace")
