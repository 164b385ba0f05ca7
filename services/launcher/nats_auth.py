"""Per-deployment NATS credentials and the server's authorization config.

One NKey user per service instance (see `shared.bus.permissions`), plus
`admin`, the provisioner and operator. Seeds are written 0600 into a 0700
directory, one file per instance (`ID.nk`); the server only learns the public
keys. `splitserve up` keeps its admin seed in memory only: no service process
can read it. The config is JSON, which nats-server reads as its own format:
`nats-server -c FILE` (the embedded server), or `include`d into an operator's
own server config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import nkeys

from contracts import Subjects, check_token
from shared.bus.permissions import ADMIN, ROLES, Permissions, Pipeline, instance_permissions, merged
from shared.private_files import private_dir, write_private


@dataclass(frozen=True)
class Instance:
    """A service instance that gets its own credential, for its job in `namespaces` (none: the deployment's; a
    further model's services, their model's; a gateway, every served model's)."""

    role: str
    instance_id: str
    namespaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in (*ROLES, ADMIN):
            raise ValueError(f"unknown role {self.role!r} (known: {', '.join(ROLES)})")
        check_token(self.instance_id, "instance id")
        if (self.instance_id == ADMIN) != (self.role == ADMIN):
            raise ValueError(f"the instance id {ADMIN!r} is the operator's")
        for namespace in self.namespaces:
            check_token(namespace, "namespace")

    def permissions(self, namespace: str, pipelines: tuple[Pipeline, ...] = (),
                    switchable: bool = False) -> Permissions:
        """What its credential may do: its job in each of its namespaces (`namespace`, the deployment's, where it
        names none); `switchable` (role switching) holds in the deployment's namespace only."""
        return merged(*(instance_permissions(self.role, self.instance_id, Subjects(space), pipelines,
                                             switchable and space == namespace)
                        for space in self.namespaces or (namespace,)))


ADMIN_INSTANCE = Instance(ADMIN, ADMIN)


def creds_path(creds_dir: str | os.PathLike, instance_id: str) -> Path:
    """The file holding one instance's NKey seed."""
    return Path(creds_dir) / f"{instance_id}.nk"


def new_seed() -> bytes:
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def ensure_credentials(creds_dir: str | os.PathLike, instances: list[Instance],
                       fresh: bool = False) -> dict[Instance, str]:
    """Each instance's public key, creating a seed file for each that has none (all anew with `fresh`)."""
    creds_dir = private_dir(creds_dir)
    public = {}
    for instance in instances:
        path = creds_path(creds_dir, instance.instance_id)
        if fresh or not path.exists():
            write_private(path, new_seed())
        public[instance] = public_key(path.read_bytes())
    return public


def public_key(seed: bytes) -> str:
    pair = nkeys.from_seed(bytearray(seed.strip()))
    try:
        return pair.public_key.decode()
    finally:
        pair.wipe()


def authorization_config(public_keys: dict[Instance, str], namespace: str,
                         pipelines: tuple[Pipeline, ...] = (), switchable: bool = False) -> dict:
    """The server's `authorization` block: one user per instance, with that instance's permissions (a stage's along
    `pipelines`; with `switchable`, each decode and prefill worker's of the deployment's namespace as both)."""
    users = [{"nkey": key, "permissions": i.permissions(namespace, pipelines, switchable).to_config()}
             for i, key in public_keys.items()]
    return {"authorization": {"users": users}}


def write_server_config(path: str | os.PathLike, public_keys: dict[Instance, str], namespace: str,
                        tls: tuple[Path, Path] | None = None, pipelines: tuple[Pipeline, ...] = (),
                        switchable: bool = False) -> Path:
    """The authorization block, and with `tls` (certificate, key) the server's TLS, required of every client."""
    path = Path(path)
    # none: no authorization at all
    config = authorization_config(public_keys, namespace, pipelines, switchable) if public_keys else {}
    if tls is not None:
        config["tls"] = {"cert_file": str(tls[0]), "key_file": str(tls[1]), "timeout": 2}
    write_private(path, (json.dumps(config, indent=1) + "\n").encode())
    return path
