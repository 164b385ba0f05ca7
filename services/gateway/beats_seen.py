"""When this gateway saw each service process beat, on its own clock.

A registry entry's `heartbeat_ms` is the worker's wall clock, and another host's clock may be seconds off this
one's. What the gateway can vouch for is its own reads: an entry with a heartbeat it had not read before was
put after its previous read began. So each process's latest beat is kept with that time, a lower bound on
when the process was last alive, measured where the stream's silence is measured too.
"""

from dataclasses import dataclass

from contracts import ServiceInfo


@dataclass(frozen=True, slots=True)
class _Beat:
    boot_id: str
    heartbeat_ms: int
    put_after: float | None  # time.monotonic(): the read before the one that first showed it (None: none before)


class BeatsSeen:
    def __init__(self) -> None:
        self._beats: dict[str, _Beat] = {}  # instance id -> its latest beat read; only what the registry lists
        self._last_read_at: float | None = None

    def read(self, entries: list[ServiceInfo], read_at: float) -> None:
        """A registry read begun at `read_at` (time.monotonic()) listed `entries`."""
        beats = {}
        for entry in entries:
            known = self._beats.get(entry.instance_id)
            if known is not None and (known.boot_id, known.heartbeat_ms) == (entry.boot_id, entry.heartbeat_ms):
                beats[entry.instance_id] = known
            else:
                beats[entry.instance_id] = _Beat(entry.boot_id, entry.heartbeat_ms, self._last_read_at)
        self._beats, self._last_read_at = beats, read_at

    def alive_after(self, instance_id: str, boot_id: str | None) -> float | None:
        """The latest time (time.monotonic()) the process `boot_id` of `instance_id` is known to have been alive
        at: its latest beat was put after it. None when nothing is known."""
        beat = self._beats.get(instance_id)
        return beat.put_after if beat is not None and beat.boot_id == boot_id else None
