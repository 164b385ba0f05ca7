"""multiprocessing's forkserver, started as a fork of this process where this process has imported its preload.

`forkserver.ensure_running()` always starts a new interpreter, which imports the preloaded modules again (torch
and transformers: several CPU seconds). A launcher that is itself a fork of a preloaded process (one a supervisor
or a test started off its own forkserver) already holds them all, and can fork its forkserver instead: the same
server loop, listening on the same kind of socket, ending when its last client does, in milliseconds.

This leans on multiprocessing's forkserver internals (the fields `ensure_running` fills in, the arguments of its
`main`), as Python 3.11 has them; `fork_forkserver` checks them first and declines where they differ (Python 3.14
adds an authentication key, for one), or where more than one thread runs: the caller then starts it the usual way.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from multiprocessing import connection, forkserver, resource_tracker

_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
_FIELDS = ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")

TITLE = "splitserve forkserver (a fork of its launcher)"


def fork_forkserver(preload: Sequence[str]) -> bool:
    """Fork this process into multiprocessing's forkserver, as `forkserver.ensure_running()` would start one;
    False (nothing done) unless every module of `preload` is imported here, this is the only thread, and the
    forkserver's internals are the ones known."""
    server = forkserver._forkserver
    if (threading.active_count() != 1 or not all(name in sys.modules for name in preload)
            or not all(hasattr(server, field) for field in _FIELDS) or hasattr(server, "_forkserver_authkey")
            or list(inspect.signature(forkserver.main).parameters) != _MAIN_PARAMETERS):
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            return True  # started already
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):  # (else the fork, and each service it forks, holds their buffers)
                with contextlib.suppress(Exception):
                    stream.flush()
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int) -> None:
    """In the fork: keep only what an interpreter started for the purpose would hold, then serve; never returns."""
    code = 1
    try:
        _close_all_but({0, 1, 2, listener_fd, alive_r})
        # (the launcher's copies of the keep-alive pipe and the tracker's pipe: closed above, forgotten here)
        forkserver._forkserver._forkserver_alive_fd = None
        forkserver._forkserver._forkserver_pid = None
        resource_tracker._resource_tracker._fd = None
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # the launcher's handlers are not the server's
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.setproctitle(TITLE)
        forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit:  # its last client ended
        code = 0
    finally:
        os._exit(code)


def _close_all_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
