"""How a service proves who it is to NATS: an NKey seed file, a NATS `.creds` file (JWT), or a seed in the environment.

`--nats-creds FILE` (or `SPLITSERVE_NATS_CREDS`) names a file holding either a
user NKey seed (`SU...`, what `splitserve up` and `splitserve nats-auth`
generate) or a decentralized-auth `.creds` file (user JWT + seed, as `nsc`
writes them). `SPLITSERVE_NATS_NKEY_SEED` gives the seed itself, for
deployments that pass secrets as environment variables. A user and password
may also ride in the URL (`nats://user:pass@host:4222`), as nats-py reads it.
The seed never appears in a repr or a log line.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from shared.telemetry.logging import get_logger

log = get_logger(__name__)

CREDS_ENV = "SPLITSERVE_NATS_CREDS"
SEED_ENV = "SPLITSERVE_NATS_NKEY_SEED"
_JWT_MARKER = b"BEGIN NATS USER JWT"


class CredentialsError(ValueError):
    """A credentials file that cannot be read or is not one NATS understands."""


@dataclass(frozen=True)
class BusCredentials:
    creds_file: str | None = None
    nkey_seed: str | None = None

    def __repr__(self) -> str:
        return f"BusCredentials(creds_file={self.creds_file!r}, nkey_seed={'<set>' if self.nkey_seed else None})"

    @property
    def given(self) -> bool:
        return bool(self.creds_file or self.nkey_seed)

    def connect_options(self) -> dict:
        """nats-py `connect()` keyword arguments; checks the file or seed first, so a bad one fails at start."""
        if self.nkey_seed:
            _check_seed(self.nkey_seed.encode(), SEED_ENV)
            return {"nkeys_seed_str": self.nkey_seed}
        if not self.creds_file:
            return {}
        path = Path(self.creds_file)
        try:
            data = path.read_bytes()
            mode = path.stat().st_mode
        except OSError as exc:
            raise CredentialsError(f"cannot read the NATS credentials file {path}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("nats credentials file is readable by other users; chmod 600 it", path=str(path),
                        mode=oct(mode & 0o777))
        if _JWT_MARKER in data:
            return {"user_credentials": str(path)}
        _check_seed(data.strip(), str(path))
        return {"nkeys_seed": str(path)}


def secured_bus(url: str, credentials: BusCredentials | None) -> bool:
    """Whether a service connects to NATS with an identity (a key, or a user in the URL): the bus is then
    secured, and the deployment's streams are the provisioner's, not the service's."""
    from urllib.parse import urlsplit

    return bool(credentials is not None and credentials.given) or any(
        urlsplit(part.strip() if "://" in part else f"nats://{part.strip()}").username for part in url.split(","))


def credentials_from(creds_file: str | None, environ: dict | None = None) -> BusCredentials:
    """The file given on the command line, else `SPLITSERVE_NATS_CREDS`, else a seed in `SPLITSERVE_NATS_NKEY_SEED`."""
    environ = os.environ if environ is None else environ
    creds_file = creds_file or environ.get(CREDS_ENV) or None
    if creds_file:
        return BusCredentials(creds_file=creds_file)
    return BusCredentials(nkey_seed=environ.get(SEED_ENV) or None)


def _check_seed(seed: bytes, where: str) -> None:
    import nkeys

    try:
        nkeys.from_seed(bytearray(seed)).wipe()
    except Exception:  # nkeys raises several error types (and binascii's) for a bad seed
        raise CredentialsError(f"{where} does not hold a NATS user NKey seed (SU...) or a .creds file") from None
