"""TLS for a service's NATS connection: verify the server against a CA, optionally present a client certificate.

`--nats-tls-ca FILE` (or `SPLITSERVE_NATS_TLS_CA`) is the CA the server's
certificate must chain to (`splitserve up --tls` makes one per deployment);
`--nats-tls-cert`/`--nats-tls-key` add a client certificate for servers that
verify clients too. The server's name or address in the NATS URL must be in its
certificate.
"""

from __future__ import annotations

import os
import ssl

TLS_ENV = {"ca": "SPLITSERVE_NATS_TLS_CA", "cert": "SPLITSERVE_NATS_TLS_CERT", "key": "SPLITSERVE_NATS_TLS_KEY"}


class TLSConfigError(ValueError):
    """TLS files that are missing, unreadable or do not belong together."""


def tls_files(ca_file: str | None, cert_file: str | None, key_file: str | None, env: dict[str, str],
              environ: dict | None = None) -> tuple[str | None, str | None, str | None]:
    """(CA, certificate, key): each as given, else from the environment variable `env` names for it."""
    environ = os.environ if environ is None else environ
    given = {"ca": ca_file, "cert": cert_file, "key": key_file}
    return tuple(given[name] or environ.get(env[name]) or None for name in ("ca", "cert", "key"))


def client_tls_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                       environ: dict | None = None) -> ssl.SSLContext | None:
    """The context that verifies the server (None when no TLS setting is given, on the command line or in the
    environment: the connection is then as the URL and the server say)."""
    ca_file, cert_file, key_file = tls_files(ca_file, cert_file, key_file, TLS_ENV, environ)
    if not (ca_file or cert_file or key_file):
        return None
    if bool(cert_file) != bool(key_file):
        raise TLSConfigError("a NATS client certificate needs both --nats-tls-cert and --nats-tls-key")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"cannot use the NATS TLS files: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
