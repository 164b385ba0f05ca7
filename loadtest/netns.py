"""Several "hosts" on this machine, for tests and benchmarks across a network: network namespaces on one bridge.

`Hosts(["a", "b", "c"])` makes a switch namespace holding a bridge, and per host a namespace whose `eth0` (a veth
whose other end is on the bridge) has an address in a private test range; loopback is up in each. Nothing is
added to the machine's own namespace. `cut(name)`/`mend(name)` take a host's link down and up; `run_in(name)`
starts a process in a host; `Hosts.thread_in(name)` moves the calling thread there (its sockets then live in
that host), for an HTTP client. Everything is removed on `close()`.
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import uuid

CLONE_NEWNET = 0x40000000


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = "ss-probe-" + uuid.uuid4().hex[:6]
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Hosts:
    def __init__(self, names: list[str]):
        tag = uuid.uuid4().hex[:6]
        self.subnet = f"10.213.{random.randint(1, 254)}"  # a private range, only inside these namespaces
        self.switch = f"ss-{tag}-sw"
        self.netns = {name: f"ss-{tag}-{name}" for name in names}
        self.address = {name: f"{self.subnet}.{i + 10}" for i, name in enumerate(names)}
        self._ports = {name: f"v{tag}{name}"[:15] for name in names}  # the bridge's end of each host's link
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name, ns in self.netns.items():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "add", self._ports[name], "type", "veth", "peer", "name", "eth0",
                    "netns", ns)
                _ip("-n", self.switch, "link", "set", self._ports[name], "master", "br0")
                _ip("-n", self.switch, "link", "set", self._ports[name], "up")
                _ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def cut(self, name: str) -> None:
        """Take the host's link down: it is cut off from the others (its own processes keep running)."""
        _ip("-n", self.switch, "link", "set", self._ports[name], "down")

    def mend(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self._ports[name], "up")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run in host `name` (`ip netns exec` execs it: the process keeps its pid)."""
        return ["ip", "netns", "exec", self.netns[name], *argv]

    def thread_in(self, name: str) -> None:
        """Move the calling thread into host `name`'s network (for a pool's initializer)."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{self.netns[name]}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns[name]} failed")
        finally:
            os.close(fd)

    def close(self) -> None:
        for ns in [*self.netns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
