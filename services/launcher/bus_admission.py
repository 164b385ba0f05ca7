"""Which instances the embedded NATS server admits, kept in step with what runs (for `splitserve up`'s launcher).

With --nats-auth the server's config names every instance that runs or is about to, each with its permissions in
its model's namespace, the gateway's in every served model's (`topology.instance_of`): rewritten and reloaded when
that changed (a scale, a model served or unserved), and waited for when some are about to start. An instance gone
has its credential revoked: a later instance of its name gets a new key.
"""

from __future__ import annotations

import time
from typing import Any

from services.launcher import topology
from services.launcher.nats_auth import ADMIN_INSTANCE, Instance, creds_path, ensure_credentials, public_key
from services.launcher.nats_auth import write_server_config
from services.launcher.nats_server import admits
from shared.bus.permissions import ROLES

ADMIT_TIMEOUT_S = 5.0  # the reloaded NATS server admitting the new instances


class Admission:
    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher  # its supervisor, planned services, models and bus are the main loop's
        self._admitted = frozenset(self.instances())  # as the config was last written

    def served_namespaces(self) -> tuple[str, ...]:
        """Every model's namespace, the deployment's first: the gateway's credential spans them."""
        return tuple(m.namespace for m in self.launcher.deployment.models)

    def instances(self, new: list[topology.ServiceSpec] = ()) -> list[Instance]:
        """The instances that run (and `new`, about to), each with its namespaces."""
        launcher = self.launcher
        running = [launcher.planned[c.name] for c in launcher.supervisor.children
                   if c.role in ROLES and c.name in launcher.planned]
        served = self.served_namespaces()
        return [topology.instance_of(spec, served) for spec in [*running, *new]]

    def admit(self, new: list[topology.ServiceSpec] = ()) -> None:
        """(main loop) The config rewritten and reloaded where what runs changed; with `new`, waited for."""
        launcher = self.launcher
        creds_dir = launcher.resolved.nats_creds_dir
        if launcher.nats is None or not launcher.options.nats_auth or creds_dir is None:
            return
        instances = self.instances(new)
        if frozenset(instances) == self._admitted:
            return
        for name in {i.instance_id for i in self._admitted} - {i.instance_id for i in instances}:
            creds_path(creds_dir, name).unlink(missing_ok=True)  # revoked
        keys = ensure_credentials(creds_dir, instances)
        keys[ADMIN_INSTANCE] = public_key(launcher.admin.nkey_seed.encode())
        tls = launcher.tls
        specs = [launcher.planned.get(i.instance_id) for i in instances]
        pipelines = topology.pipelines_of([*(s for s in specs if s is not None), *new])
        write_server_config(launcher.run_dir / "nats.conf", keys, launcher.options.namespace,
                            (tls.cert, tls.key) if tls is not None else None, pipelines, launcher.options.role_switch)
        launcher.nats.reload()
        self._admitted = frozenset(instances)
        if new:
            self._wait_admitted(creds_path(creds_dir, new[0].instance_id))

    def _wait_admitted(self, creds_file) -> None:
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        run = self.launcher.resolved
        while not admits(run.nats_url, creds_file, run.nats_tls_ca):
            if time.monotonic() >= deadline:
                self.launcher.say(f"warning: the NATS server did not admit the new instances within "
                                  f"{ADMIT_TIMEOUT_S:g} s; starting them anyway")
                return
            time.sleep(0.1)
