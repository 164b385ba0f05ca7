"""Per-deployment NATS credentials and the server's authorization config.

One NKey user per role (see `shared.bus.permissions`), plus `admin` for the
operator. Seeds are written 0600 into a 0700 directory and never leave it; the
server only learns the public keys. The config is JSON, which nats-server reads
as its own format: `nats-server -c FILE` (the embedded server), or `include`d
into an operator's own server config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nkeys

from contracts import Subjects
from shared.bus.permissions import ADMIN, ROLES, role_permissions
from shared.private_files import private_dir, write_private

CREDENTIAL_ROLES = (*ROLES, ADMIN)


def creds_path(creds_dir: str | os.PathLike, role: str) -> Path:
    """The file holding `role`'s NKey seed."""
    return Path(creds_dir) / f"{role}.nk"


def ensure_credentials(creds_dir: str | os.PathLike, roles: tuple[str, ...] = CREDENTIAL_ROLES,
                       fresh: bool = False) -> dict[str, str]:
    """Each role's public key, creating a seed for each role that has none (all anew with `fresh`)."""
    creds_dir = private_dir(creds_dir)
    public = {}
    for role in roles:
        path = creds_path(creds_dir, role)
        if fresh or not path.exists():
            write_private(path, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        public[role] = public_key(path)
    return public


def public_key(seed_file: str | os.PathLike) -> str:
    pair = nkeys.from_seed(bytearray(Path(seed_file).read_bytes().strip()))
    try:
        return pair.public_key.decode()
    finally:
        pair.wipe()


def authorization_config(public_keys: dict[str, str], namespace: str) -> dict:
    """The server's `authorization` block: one user per role, with that role's permissions."""
    subjects = Subjects(namespace)
    users = [{"nkey": key, "permissions": role_permissions(role, subjects).to_config()}
             for role, key in public_keys.items()]
    return {"authorization": {"users": users}}


def write_server_config(path: str | os.PathLike, public_keys: dict[str, str], namespace: str,
                        tls: tuple[Path, Path] | None = None) -> Path:
    """The authorization block, and with `tls` (certificate, key) the server's TLS, required of every client."""
    path = Path(path)
    config = authorization_config(public_keys, namespace) if public_keys else {}  # none: no authorization at all
    if tls is not None:
        config["tls"] = {"cert_file": str(tls[0]), "key_file": str(tls[1]), "timeout": 2}
    write_private(path, (json.dumps(config, indent=1) + "\n").encode())
    return path
