"""`splitserve provision`: make a deployment's streams, consumers and registry bucket on a NATS you run.

Services on a secured bus may only bind to these; run this once with the admin
key `splitserve nats-auth` wrote (and again after a change of version or
--nats-replicas), before or while the services start: they wait for it.
"""

import argparse


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser("provision", help="make the deployment's JetStream streams and registry bucket",
                                    description=__doc__.split("\n\n", 1)[1])
    from services.common.service_settings import BusSettings
    from services.common.settings import default_of

    parser.add_argument("--nats", default=default_of(BusSettings, "nats"),
                        help="the NATS server (URL,URL,... for a cluster)")
    parser.add_argument("--nats-creds", metavar="FILE", help="the admin key (DIR/admin.nk of `splitserve nats-auth`; "
                        "or its seed in SPLITSERVE_NATS_NKEY_SEED, as DIR/admin.env sets it); none on an open bus")
    parser.add_argument("--nats-tls-ca", metavar="FILE", help="the CA the NATS server's certificate is signed by "
                        "(default: SPLITSERVE_NATS_TLS_CA)")
    parser.add_argument("--namespace", default=default_of(BusSettings, "namespace"),
                        help="the deployment's subject prefix")
    parser.add_argument("--nats-replicas", type=int, metavar="N", help="copies of each stream on a NATS cluster "
                        "(default: 3 on a cluster of 3 nodes or more, else 1)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from services.launcher.provision import provision
    from shared.bus.credentials import CredentialsError, credentials_from
    from shared.bus.tls import TLS_ENV
    from shared.telemetry.logging import configure_logging

    configure_logging("provision", "provision", "warning")

    try:
        credentials = credentials_from(args.nats_creds)
        credentials.connect_options()
        provision(args.nats, args.namespace, credentials if credentials.given else None,
                  args.nats_tls_ca or os.environ.get(TLS_ENV["ca"]), args.nats_replicas)
    except (CredentialsError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    except Exception as exc:  # the server refused or is not there
        raise SystemExit(f"error: could not provision {args.namespace!r} on {args.nats}: {exc}") from None
    print(f"provisioned {args.namespace!r} on {args.nats}")
    return 0
