"""A splitserve deployment across network-namespace "hosts" (`loadtest.netns.Hosts`), each service started as an
operator would on its own machine: `splitserve serve ROLE --nats URL,URL,URL` with its role's key.

Every host runs a NATS server; the three form one cluster (routes between the hosts, JetStream replicated). Each
host is its own shared-memory domain (`SPLITSERVE_HOST_ID`), so KV between hosts goes over TCP; with `tls=True`
every side channel speaks TLS only (certificates from a CA made for the deployment, naming each host's address).
`on(host, fn)` runs `fn` in a thread living in that host's network (an HTTP client, a NATS client).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats

from contracts import ServiceStats, StatsRequest, Subjects
from loadtest.netns import Hosts
from services.launcher.nats_server import ClusterRoutes, find_nats_server, host_port, jetstream_answers
from services.launcher.procs import signal_group
from services.launcher.provision import provision
from services.launcher.tls_files import make_deployment_tls
from services.launcher.topology import SIDE_CHANNEL_ROLES
from shared.bus.credentials import credentials_from
from shared.bus.permissions import ADMIN, inbox_prefix

ROOT = Path(__file__).resolve().parent.parent


class HostsDeployment:
    def __init__(self, hosts: Hosts, run_dir: Path, namespace: str = "hosts", client_host: str = "a",
                 tls: bool = False):
        self.hosts, self.dir, self.namespace = hosts, Path(run_dir), namespace
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[str, list[str]]] = {}
        self.clients = {name: ThreadPoolExecutor(8, initializer=hosts.thread_in, initargs=(name,))
                        for name in hosts.netns}
        self.client_host = client_host
        self.creds = self.dir / "creds"
        subprocess.run([sys.executable, "-m", "services.cli.main", "nats-auth", str(self.creds), "--namespace",
                        namespace], check=True, capture_output=True, cwd=ROOT, timeout=60)
        self.nats_url = ",".join(f"nats://{hosts.address[h]}:4222" for h in hosts.netns)
        self.transfer_tls: list[str] = []
        if tls:
            addresses = list(hosts.address.values())
            files = make_deployment_tls(self.dir / "tls", addresses, addresses)
            self.transfer_tls = ["--transfer-tls-ca", str(files.ca_cert), "--transfer-tls-cert",
                                 str(files.transfer_cert), "--transfer-tls-key", str(files.transfer_key)]

    def start(self, host: str, name: str, argv: list[str]) -> None:
        self.commands[name] = (host, argv)
        log = open(self.dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            self.hosts.command(host, argv), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**_env(), "SPLITSERVE_HOST_ID": f"host-{host}"})

    def stop_one(self, name: str, timeout_s: float = 10.0) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)

    def restart(self, name: str) -> None:
        self.stop_one(name)
        host, argv = self.commands[name]
        self.start(host, name, argv)

    def start_nats(self, timeout_s: float = 30.0) -> None:
        """A NATS server on every host, clustered, each admitting only the deployment's roles."""
        routes = tuple(host_port(address, 6222) for address in self.hosts.address.values())
        for h, address in self.hosts.address.items():
            config = self.creds / f"nats-{h}.conf"  # beside nats-auth.conf, which it includes
            config.write_text(
                f'server_name: "nats-{h}"\nlisten: "{host_port(address, 4222)}"\n'
                f'jetstream {{ store_dir: "{self.dir / ("store-" + h)}" }}\ninclude "nats-auth.conf"\n'
                + ClusterRoutes("splitserve", host_port(address, 6222), routes, "route", "route-secret").config())
            self.start(h, f"nats-{h}", [str(find_nats_server()), "-c", str(config)])
        deadline = time.monotonic() + timeout_s
        while not self.on(self.client_host, jetstream_answers, self.nats_url, self.creds / "admin.nk"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the NATS cluster had no JetStream leader within {timeout_s:g} s")
            time.sleep(0.3)
        # The operator's step: the streams and registry, with the admin key (the services only bind to them).
        self.on(self.client_host, provision, self.nats_url, self.namespace,
                credentials_from(str(self.creds / "admin.nk"), environ={}), None, len(self.hosts.netns))

    def serve(self, host: str, role: str, instance: str, *args: str) -> None:
        tls = self.transfer_tls if role in SIDE_CHANNEL_ROLES else []
        self.start(host, instance, [sys.executable, "-m", "services.cli.main", "serve", role, "--nats", self.nats_url,
                                    "--nats-replicas", str(len(self.hosts.netns)), "--namespace", self.namespace,
                                    "--nats-creds", str(self.creds / f"{instance}.nk"), "--instance-id", instance, *tls,
                                    *args])

    def nats_node_of(self, name: str) -> str:
        """The NATS node (`nats-HOST`) the service `name` is connected to: the last one its log says it connected
        or reconnected to."""
        servers = [json.loads(line)["server"] for line in (self.dir / f"{name}.log").read_text().splitlines()
                   if line.startswith("{") and ('"nats connected"' in line or '"nats reconnected"' in line)]
        if not servers:
            raise RuntimeError(f"{name} has not said it connected to NATS")
        address = servers[-1].rsplit(":", 1)[0]
        for host, a in self.hosts.address.items():
            if a == address:
                return f"nats-{host}"
        raise RuntimeError(f"{name} is connected to {servers[-1]}, no host's NATS node")

    def report(self, lines: int = 12) -> str:
        """Each process that has exited, with its code and the end of its log: why a deployment is not ready."""
        parts = []
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"{name} exited with {proc.returncode}:\n" + "\n".join(tail))
        return "\n".join(parts) or "every process is running"

    def on(self, host: str, fn, *args, **kwargs):
        return self.clients[host].submit(fn, *args, **kwargs).result(timeout=3600)

    def gateway_ready(self, url: str = "http://127.0.0.1:8000") -> bool:
        """Whether the gateway at `url` (on the client host) says every expected service is ready."""
        import httpx

        try:
            response = self.on(self.client_host, httpx.get, url + "/ready", timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json()["status"] == "ready"

    def workers_seen(self, scheduler: str = "scheduler-0") -> dict[str, int]:
        """The roles the scheduler sees ready (asked over NATS as the operator)."""
        async def ask():
            options = credentials_from(str(self.creds / "admin.nk"), environ={}).connect_options()
            # (its answers go only into inboxes the services may answer: the operator's is the admin's prefix)
            nc = await nats.connect(servers=self.nats_url.split(","),
                                    inbox_prefix=inbox_prefix(self.namespace, ADMIN, ADMIN), **options)
            try:
                reply = await nc.request(Subjects(self.namespace).stats(scheduler), StatsRequest().encode(), timeout=5)
                return ServiceStats.decode(reply.data).details["workers_seen"]
            finally:
                await nc.close()
        return self.on(self.client_host, asyncio.run, ask())

    def stop(self) -> None:
        for name in reversed(list(self.procs)):  # the services, then NATS
            self.stop_one(name)
        for pool in self.clients.values():
            pool.shutdown(wait=False, cancel_futures=True)


def _env() -> dict:
    import os

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
