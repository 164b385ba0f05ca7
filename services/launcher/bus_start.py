"""The deployment's bus as `up` starts it: the embedded NATS server (or cluster), its config, credentials and
TLS made here; or a --nats server, whose credentials are checked."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from services.launcher import topology
from services.launcher.launch_checks import LaunchError
from services.launcher.log_files import RotatingLog
from services.launcher.nats_auth import (
    ADMIN_INSTANCE,
    creds_path,
    ensure_credentials,
    new_seed,
    public_key,
    write_server_config,
)
from services.launcher.nats_server import EmbeddedNatsCluster, jetstream_answers
from services.launcher.tls_files import TLSFiles, make_deployment_tls
from services.launcher.up_settings import UpSettings
from shared.bus.credentials import BusCredentials, credentials_from
from shared.bus.permissions import ADMIN

FAILED_START_STOP_S = 2.0  # a server of a cluster that failed to start as a whole: stopped within this


@dataclass
class StartedBus:
    url: str
    nats: EmbeddedNatsCluster | None = None  # the embedded servers, supervised by `up`
    creds_dir: str | Path | None = None  # every planned instance's credentials
    admin: BusCredentials | None = None  # the provisioner's key (of the embedded server: in this process only)
    tls: TLSFiles | None = None  # the embedded server's, with --tls
    tls_ca: str | None = None
    transfer_tls: tuple[str, str, str] | None = None  # (CA, certificate, key) of the side channel


def start_embedded_bus(o: UpSettings, run_dir: Path, log_dir: Path,
                       planned: list[topology.ServiceSpec]) -> StartedBus:
    """The embedded server (or cluster), started from empty streams, with its config, credentials and TLS."""
    # A fresh deployment starts from empty streams: what an earlier one left queued has nobody waiting for it.
    shutil.rmtree(run_dir / "nats", ignore_errors=True)
    # Every receiver advertises 127.0.0.1 here: its certificate names that (and localhost).
    names = ["127.0.0.1", "localhost"]
    tls = make_deployment_tls(run_dir / "tls", names, names) if o.tls else None
    tls_ca = str(tls.ca_cert) if tls is not None else None
    transfer_tls = (str(tls.ca_cert), str(tls.transfer_cert), str(tls.transfer_key)) if tls else None
    creds_dir, admin, server_config = (_server_config(o, run_dir, tls, planned) if o.nats_auth or tls is not None
                                       else (None, None, None))
    cluster = EmbeddedNatsCluster(
        run_dir, o.nats_cluster, config_file=server_config,
        log_for=lambda name: RotatingLog(log_dir / f"{name}.log", o.log_max_bytes, o.log_backups))
    try:
        url = cluster.start(jetstream_ready=lambda url: jetstream_answers(url, admin, tls_ca))
    except BaseException:
        cluster.stop(FAILED_START_STOP_S)  # the servers that did start are not left behind
        raise
    return StartedBus(url, cluster, creds_dir, admin, tls, tls_ca, transfer_tls)


def _server_config(o: UpSettings, run_dir: Path, tls: TLSFiles | None, specs: list[topology.ServiceSpec]
                   ) -> tuple[Path | None, BusCredentials | None, Path]:
    """(creds dir, admin key, config file) of the embedded server: with --nats-auth new credentials for every
    service instance in RUN_DIR/creds, an admin key kept in this process only, and the users that admit them;
    with --tls its certificate."""
    creds_dir = run_dir / "creds" if o.nats_auth else None
    public_keys = {}
    admin = None
    if creds_dir is not None:
        shutil.rmtree(creds_dir, ignore_errors=True)  # an earlier deployment's instances are not admitted
        public_keys = ensure_credentials(creds_dir, topology.instances_of(specs), fresh=True)
        admin_seed = new_seed()
        public_keys[ADMIN_INSTANCE] = public_key(admin_seed)
        admin = BusCredentials(nkey_seed=admin_seed.decode())
    config = write_server_config(run_dir / "nats.conf", public_keys, o.namespace,
                                 (tls.cert, tls.key) if tls is not None else None, topology.pipelines_of(specs),
                                 o.role_switch)
    return creds_dir, admin, config


def external_bus(o: UpSettings, planned: list[topology.ServiceSpec]) -> StartedBus:
    """The --nats server: every planned instance's credentials must be in --nats-creds-dir (its admin.nk, where
    there, is the provisioner's key); no side channel TLS."""
    creds_dir = o.nats_creds_dir
    admin = None
    if creds_dir is not None:
        missing = [s.instance_id for s in planned if not creds_path(creds_dir, s.instance_id).is_file()]
        if missing:
            raise LaunchError(f"--nats-creds-dir {creds_dir} lacks the credentials of: {', '.join(missing)} "
                              "(`splitserve nats-auth DIR --instance ROLE:ID[@NAMESPACE] ...` writes them)", 2)
        admin_file = creds_path(creds_dir, ADMIN)
        admin = credentials_from(str(admin_file), environ={}) if admin_file.is_file() else None
    return StartedBus(o.nats, creds_dir=creds_dir, admin=admin, tls_ca=o.nats_tls_ca)
