"""`splitserve nats-auth DIR`: credentials and server authorization for a deployment on a NATS you run.

`splitserve up` does this by itself for its embedded server. For a NATS server
of your own (another host, a cluster, docker compose), run this once: it writes
DIR/ID.nk for every service instance (--instance ROLE:ID; 0600, in a 0700
directory; existing ones are kept unless --rotate), the same key as DIR/ID.env
(`SPLITSERVE_NATS_NKEY_SEED=`, for compose's `env_file`), DIR/admin.nk (the
provisioner's and operator's key: `splitserve provision` makes the deployment's
streams with it; keep it off the services' hosts), and DIR/nats-auth.conf, the
server's `authorization` block. Each instance may use only its own subjects and
registry entry. Each service then takes its own file with `--nats-creds` (or
`SPLITSERVE_NATS_CREDS`), or the seed in its environment.

A deployment serving several models runs each further model's services in a
namespace of their own (`splitserve models served` prints it): give them as
--instance ROLE:ID@NAMESPACE (e.g. decode:m1-decode-0@splitserve-b). A gateway
(given without @) may then use every namespace DIR knows, its own first: it
routes to every model.

With --tls-name, it also makes a CA and a certificate for the server under
those names (its key in DIR/tls, the CA's certificate in DIR/public/ca.pem,
readable by all: it is not a secret); the config then requires TLS and each
ROLE.env names the CA (SPLITSERVE_NATS_TLS_CA).
"""

import argparse
import json
import os
import shutil
from pathlib import Path

from contracts import check_token
from services.launcher.nats_auth import Instance
from shared.bus.permissions import Pipeline

INSTANCES_FILE = "instances.json"  # which instance each key is for, its role, and the pipelines
DEFAULT_PIPELINES = (Pipeline("stage-0", ("stage-1",)),)
DEFAULT_INSTANCES = (Instance("gateway", "gateway-0"), Instance("scheduler", "scheduler-0"),
                     Instance("decode", "decode-0"), Instance("prefill", "prefill-0"),
                     Instance("kvstore", "kvstore-0"), Instance("stage", "stage-0"), Instance("stage", "stage-1"))


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "nats-auth",
        help="write per-role NATS credentials and the server's authorization config",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", metavar="DIR", help="where to write ID.nk, admin.nk and nats-auth.conf")
    from services.common.service_settings import BusSettings
    from services.common.settings import default_of

    namespace = default_of(BusSettings, "namespace")
    parser.add_argument("--namespace", default=namespace,
                        help=f"the deployment's subject prefix (default: {namespace})")
    parser.add_argument("--rotate", action="store_true", help="new keys for every instance (restart the server and "
                        "services)")
    parser.add_argument("--instance", action="append", metavar="ROLE:ID[@NAMESPACE]", type=_instance,
                        help="a service instance that gets its own key (repeatable), added to those DIR already "
                             "admits (DIR/instances.json); @NAMESPACE: it serves a further model, in that model's "
                             "namespace (default: --namespace); the first time, without it: "
                             f"{' '.join(f'{i.role}:{i.instance_id}' for i in DEFAULT_INSTANCES)}, what the compose "
                             "files, the k8s manifests and `splitserve up`'s default deployments run")
    parser.add_argument("--pipeline", action="append", metavar="HEAD:STAGE[,STAGE...]", type=_pipeline,
                        help="a pipeline's head and its stages in layer order (repeatable; kept in "
                             "DIR/instances.json): a stage may send steps only to the next stage and back to its "
                             "head (the first time, without it: stage-0:stage-1, the pipeline compose file's)")
    parser.add_argument("--role-switch", action=argparse.BooleanOptionalAction, default=None,
                        help="each decode and prefill instance may serve as either (`up --role-switch`, `splitserve "
                             "switch`): its key holds both roles' permissions under its own name (kept in "
                             "DIR/instances.json; the first time, without it: off)")
    parser.add_argument("--tls-name", action="append", metavar="NAME",
                        help="make a CA and a TLS certificate for the NATS server under NAME (repeatable: every "
                             "host name or address clients dial it by, e.g. `nats` in compose)")
    parser.add_argument("--transfer-tls-name", action="append", metavar="NAME",
                        help="with --tls-name: the same CA also signs a certificate for the model workers' side "
                             "channel under NAME (repeatable: every address their KV receivers advertise), "
                             "written to DIR/tls/transfer.pem and transfer-key.pem (give each worker "
                             "--transfer-tls-ca DIR/public/ca.pem --transfer-tls-cert ... --transfer-tls-key ...)")
    parser.add_argument("--server-dir", metavar="PATH",
                        help="where the NATS server sees DIR (e.g. /etc/nats/secrets in its container); the config "
                             "names its certificate there (default: DIR)")
    parser.add_argument("--cluster-route", action="append", metavar="HOST:PORT",
                        help="the servers form a cluster: every server's route address (repeatable). Writes "
                             "DIR/nats-cluster.conf (its routes authenticated with a password made here and kept "
                             "until --rotate) and DIR/nats-server.conf, which includes it and nats-auth.conf: run "
                             "each server with `--config DIR/nats-server.conf --server_name NAME`")
    parser.add_argument("--cluster-listen", default="0.0.0.0:6222", metavar="HOST:PORT",
                        help="with --cluster-route: where each server listens for routes (default: 0.0.0.0:6222)")
    parser.add_argument("--client-ca-path", metavar="PATH",
                        help="where services see DIR/public/ca.pem, written into ROLE.env (default: its path here)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from contracts import check_token
    from services.launcher.nats_auth import ADMIN_INSTANCE, creds_path, ensure_credentials, write_server_config
    from services.launcher.tls_files import make_deployment_tls
    from shared.bus.credentials import SEED_ENV
    from shared.bus.tls import TLS_ENV
    from shared.private_files import write_private

    try:
        check_token(args.namespace, "namespace")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    creds_dir = Path(args.dir)
    known, known_pipelines, known_switchable = _known(creds_dir)
    switchable = known_switchable if args.role_switch is None else args.role_switch
    instances = list(dict.fromkeys([*known, *(args.instance or ([] if known else DEFAULT_INSTANCES))]))
    instances = with_gateway_namespaces(instances, args.namespace)
    pipelines = tuple(dict.fromkeys([*known_pipelines,
                                     *(args.pipeline or ([] if known else DEFAULT_PIPELINES))]))
    duplicate = {i.instance_id for i in instances if sum(j.instance_id == i.instance_id for j in instances) > 1}
    if duplicate:
        raise SystemExit(f"error: each instance id names one instance: {', '.join(sorted(duplicate))} is given "
                         "two roles")
    public_keys = ensure_credentials(creds_dir, [*instances, ADMIN_INSTANCE], fresh=args.rotate)
    public = creds_dir / "public"  # (made even without TLS: compose mounts it)
    public.mkdir(mode=0o755, exist_ok=True)
    os.chmod(public, 0o755)
    tls, ca_env = None, ""
    if args.transfer_tls_name and not args.tls_name:
        raise SystemExit("error: --transfer-tls-name needs --tls-name: the tickets that open the side channel "
                         "travel over NATS, so TLS starts there")
    if args.tls_name:
        files = make_deployment_tls(creds_dir / "tls", args.tls_name, args.transfer_tls_name)
        shutil.copyfile(files.ca_cert, public / "ca.pem")
        os.chmod(public / "ca.pem", 0o644)
        server_dir = Path(args.server_dir) if args.server_dir else creds_dir.resolve()
        tls = (server_dir / "tls" / files.cert.name, server_dir / "tls" / files.key.name)
        ca_env = f"{TLS_ENV['ca']}={args.client_ca_path or (public / 'ca.pem').resolve()}\n"
    for instance in public_keys:
        seed = creds_path(creds_dir, instance.instance_id).read_text().strip()
        write_private(creds_dir / f"{instance.instance_id}.env", f"{SEED_ENV}={seed}\n{ca_env}".encode())
    config = write_server_config(creds_dir / "nats-auth.conf", public_keys, args.namespace, tls, pipelines,
                                 switchable)
    known_now = {"instances": {i.instance_id: _kept(i) for i in instances},
                 "pipelines": [[p.head, list(p.stages)] for p in pipelines], "role_switch": switchable}
    write_private(creds_dir / INSTANCES_FILE, (json.dumps(known_now, indent=1) + "\n").encode())
    print(f"wrote ID.nk and ID.env for {', '.join(i.instance_id for i in public_keys)}, and {config.name}, "
          f"in {creds_dir}")
    if args.cluster_route:
        cluster = write_cluster_config(creds_dir, args.cluster_route, args.cluster_listen, args.rotate)
        print(f"cluster: each server `nats-server --jetstream --config {cluster.resolve()} --server_name NAME`")
    print(f"server: `nats-server --jetstream --config {config.resolve()}`, or `include` it (a path relative to "
          "your config file) in your own config")
    if args.transfer_tls_name:
        print(f"side channel: give each model worker and the kv-store `--transfer-tls-ca {(public / 'ca.pem').resolve()} "
              f"--transfer-tls-cert {files.transfer_cert.resolve()} --transfer-tls-key {files.transfer_key.resolve()}`")
    for namespace in namespaces_of(instances, args.namespace):
        print(f"provision: `splitserve provision --nats URL --nats-creds {creds_dir.resolve()}/admin.nk --namespace "
              f"{namespace}` (once, and after --rotate), then keep admin.nk away from the services")
    print(f"services: `splitserve serve ROLE --instance-id ID --nats-creds {creds_dir.resolve()}/ID.nk ...`, or "
          f"`splitserve up --nats URL --nats-creds-dir {creds_dir.resolve()}`")
    return 0


def _known(creds_dir: Path) -> tuple[list[Instance], list[Pipeline], bool]:
    """The instances an earlier run wrote keys for, the pipelines it declared, and whether its decode and prefill
    instances switch roles (DIR/instances.json)."""
    try:
        known = json.loads((creds_dir / INSTANCES_FILE).read_text())
        return ([_instance(_spelled(instance_id, role)) for instance_id, role in known["instances"].items()],
                [Pipeline(head, tuple(stages)) for head, stages in known["pipelines"]],
                bool(known.get("role_switch", False)))
    except FileNotFoundError:
        return [], [], False
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"error: cannot read {creds_dir / INSTANCES_FILE}: {exc!r}") from None


def _pipeline(text: str) -> Pipeline:
    head, sep, stages = text.partition(":")
    names = [name for name in stages.split(",") if name]
    try:
        if not sep or not names:
            raise ValueError("expected HEAD:STAGE[,STAGE...], e.g. stage-0:stage-1")
        for name in (head, *names):
            check_token(name, "instance id")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Pipeline(head, tuple(names))


def _instance(text: str) -> Instance:
    """ROLE:ID, or ROLE:ID@NAMESPACE (a further model's service, in that model's namespace)."""
    role, sep, named = text.partition(":")
    instance_id, at, namespace = named.partition("@")
    try:
        if not sep or (at and not namespace):
            raise ValueError("expected ROLE:ID[@NAMESPACE], e.g. decode:decode-1 or decode:m1-decode-0@splitserve-b")
        return Instance(role, instance_id, (namespace,) if namespace else ())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kept(instance: Instance) -> str:
    """ROLE[@NAMESPACE], as DIR/instances.json keeps an instance (a gateway's namespaces: every model's, each run)."""
    if instance.role == "gateway" or not instance.namespaces:
        return instance.role
    return f"{instance.role}@{instance.namespaces[0]}"


def _spelled(instance_id: str, known_role: str) -> str:
    """ROLE:ID[@NAMESPACE] of an instance as DIR/instances.json keeps it (ID: ROLE[@NAMESPACE])."""
    role, at, namespace = known_role.partition("@")
    return f"{role}:{instance_id}{at}{namespace}"


def namespaces_of(instances: list[Instance], namespace: str) -> list[str]:
    """Every namespace the instances serve in, the deployment's (`namespace`) first."""
    return list(dict.fromkeys([namespace, *(ns for i in instances for ns in i.namespaces)]))


def with_gateway_namespaces(instances: list[Instance], namespace: str) -> list[Instance]:
    """Each gateway given without a namespace spans every namespace the others serve in (it routes to every
    model), its own first."""
    spans = tuple(namespaces_of([i for i in instances if i.role != "gateway"], namespace))
    return [Instance(i.role, i.instance_id, spans) if i.role == "gateway" and len(spans) > 1 else i
            for i in instances]


def write_cluster_config(creds_dir: Path, routes: list[str], listen: str, rotate: bool) -> Path:
    """DIR/nats-cluster.conf (the cluster block, 0600) and DIR/nats-server.conf (it and nats-auth.conf)."""
    import secrets

    from services.launcher.nats_server import ClusterRoutes
    from shared.private_files import write_private

    password_file = creds_dir / "route.password"
    if rotate or not password_file.exists():
        write_private(password_file, secrets.token_urlsafe(24).encode())
    password = password_file.read_text().strip()
    block = ClusterRoutes("splitserve", listen, tuple(routes), "route", password).config()
    write_private(creds_dir / "nats-cluster.conf", block.encode())
    server = creds_dir / "nats-server.conf"
    write_private(server, b'include "nats-auth.conf"\ninclude "nats-cluster.conf"\n')
    return server
