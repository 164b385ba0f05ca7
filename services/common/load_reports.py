"""`LoadReports`: the loads a connector finished on the event loop, waiting for the engine thread to take them."""

import threading
from collections.abc import Callable

from shared.engine import LoadEnd


class LoadReports:
    def __init__(self, wake: Callable[[], None]):
        """`wake()`: get the engine loop stepping again (it may be waiting for exactly this)."""
        self._wake = wake
        self._lock = threading.Lock()
        self._ended: list[LoadEnd] = []

    def report(self, end: LoadEnd) -> None:
        """(Any thread, once the load's last write is done.)"""
        with self._lock:
            self._ended.append(end)
        self._wake()

    def take(self) -> list[LoadEnd]:
        """(Engine thread, as the connector's `finished_loads`.) Those reported since the last call."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended
