"""A private certificate authority for one deployment, and the server certificate it signs (`splitserve up --tls`).

The CA's key signs one certificate, for the deployment's NATS server, naming
every address the services may dial it by, and is then thrown away: nothing
else will ever be signed by it. Services trust only this CA (`--nats-tls-ca`),
so they talk to this deployment's server and no other. Files are 0600 in a
0700 directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.private_files import private_dir, write_private

VALID_DAYS = 397  # what public CAs may issue for; a deployment runs far shorter


@dataclass(frozen=True)
class TLSFiles:
    ca_cert: Path
    cert: Path
    key: Path


def server_names(host: str) -> list[str]:
    """Every name a client on this machine or the network may reach a server bound to `host` by."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    if host not in ("", "0.0.0.0", "::"):
        names.append(host)
    return list(dict.fromkeys(names))


def make_deployment_tls(directory: str | os.PathLike, names: list[str]) -> TLSFiles:
    """A new CA and a server certificate for `names` (host names or IP addresses), written into `directory`."""
    directory = private_dir(directory)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitserve deployment CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    write_private(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    write_private(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    write_private(files.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    return files


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
