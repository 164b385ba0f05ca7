"""A private certificate authority for one deployment, and the server certificates it signs (`splitserve up --tls`).

The CA's key signs one or two certificates and is then thrown away: nothing else will
ever be signed by it. One is the deployment's NATS server's, naming every
address the services may dial it by; the other is the model workers' side
channel's (`--transfer-tls-cert`), naming every address their KV receivers
advertise. Services trust only this CA (`--nats-tls-ca`, `--transfer-tls-ca`),
so they talk to this deployment's server and workers and no others. Files are
0600 in a 0700 directory.
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
    cert: Path  # the NATS server's
    key: Path
    transfer_cert: Path | None  # the side channel's receivers' (None: not made)
    transfer_key: Path | None


def server_names(host: str) -> list[str]:
    """Every name a client on this machine or the network may reach a server bound to `host` by."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    if host not in ("", "0.0.0.0", "::"):
        names.append(host)
    return list(dict.fromkeys(names))


def make_deployment_tls(directory: str | os.PathLike, names: list[str],
                        transfer_names: list[str] | None = None) -> TLSFiles:
    """A new CA, and certificates for the NATS server (`names`: host names or IP addresses) and, given
    `transfer_names`, the workers' side channel, written into `directory`."""
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
    files = TLSFiles(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem",
                     *((directory / "transfer.pem", directory / "transfer-key.pem") if transfer_names else (None, None)))
    write_private(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_server_certificate(ca_key, ca_name, names, files.cert, files.key, now)
    if transfer_names:
        _write_server_certificate(ca_key, ca_name, transfer_names, files.transfer_cert, files.transfer_key, now)
    return files


def _write_server_certificate(ca_key, ca_name: x509.Name, names: list[str], cert_path: Path, key_path: Path,
                              now: datetime.datetime) -> None:
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
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
