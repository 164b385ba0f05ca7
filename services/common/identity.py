"""Who a running service is: the fields every registry entry starts with."""

import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from contracts import ServiceInfo


def now_ms() -> int:
    """Wall-clock unix time in milliseconds (deadlines and timestamps on the wire)."""
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class ServiceIdentity:
    instance_id: str
    role: str
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # new at every process start
    started_ms: int = field(default_factory=now_ms)

    def info(self, **fields) -> ServiceInfo:
        """A registry entry for this service now; `fields` fill in the rest (state, load, ...)."""
        return ServiceInfo(instance_id=self.instance_id, role=self.role, boot_id=self.boot_id, pid=os.getpid(),
                           host=socket.gethostname(), started_ms=self.started_ms, heartbeat_ms=now_ms(), **fields)
