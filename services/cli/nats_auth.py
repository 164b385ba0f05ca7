"""`splitserve nats-auth DIR`: credentials and server authorization for a deployment on a NATS you run.

`splitserve up` does this by itself for its embedded server. For a NATS server
of your own (another host, a cluster, docker compose), run this once: it
writes DIR/ROLE.nk for every role (0600, in a 0700 directory; existing ones are
kept unless --rotate), the same key as DIR/ROLE.env (`SPLITSERVE_NATS_NKEY_SEED=`,
for compose's `env_file`), and DIR/nats-auth.conf, the server's `authorization`
block. Each service then takes its role's file with `--nats-creds` (or
`SPLITSERVE_NATS_CREDS`), or the seed in its environment.
"""

import argparse
from pathlib import Path


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "nats-auth",
        help="write per-role NATS credentials and the server's authorization config",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", metavar="DIR", help="where to write ROLE.nk and nats-auth.conf")
    parser.add_argument("--namespace", default="splitserve", help="the deployment's subject prefix (default: splitserve)")
    parser.add_argument("--rotate", action="store_true", help="new keys for every role (restart the server and services)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from contracts import check_token
    from services.launcher.nats_auth import creds_path, ensure_credentials, write_private, write_server_config
    from shared.bus.credentials import SEED_ENV

    try:
        check_token(args.namespace, "namespace")
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    creds_dir = Path(args.dir)
    public_keys = ensure_credentials(creds_dir, fresh=args.rotate)
    for role in public_keys:
        seed = creds_path(creds_dir, role).read_text().strip()
        write_private(creds_dir / f"{role}.env", f"{SEED_ENV}={seed}\n".encode())
    config = write_server_config(creds_dir / "nats-auth.conf", public_keys, args.namespace)
    print(f"wrote ROLE.nk and ROLE.env for {', '.join(public_keys)}, and {config.name}, in {creds_dir}")
    print(f"server: `nats-server --jetstream --config {config.resolve()}`, or `include` it (a path relative to "
          "your config file) in your own config")
    print(f"services: `splitserve serve ROLE --nats-creds {creds_dir.resolve()}/ROLE.nk ...`, or "
          f"`splitserve up --nats URL --nats-creds-dir {creds_dir.resolve()}`")
    return 0
