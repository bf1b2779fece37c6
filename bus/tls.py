"""TLS material for the bus: a private CA and server certificates (``rudder up --tls``, tests).

Production brings its own certificates (cert-manager in Kubernetes, files in compose); this makes
a throwaway CA for one machine. Keys are written 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bus.authority import write_secret


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


# Server certificates serve clients and, between the nodes of a cluster, routes: a route is dialled
# with the node's own certificate, and NATS verifies route certificates in both directions, so the
# certificate is for client use too (without it a TLS-secured cluster never forms: "certificate
# specifies an incompatible key usage").
_SERVER_USES = [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]


def make_server_tls(folder: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                    days: int = 825) -> TlsFiles:
    """A CA and one server certificate for ``hosts`` (IP addresses or DNS names), for client
    connections and for routes between cluster nodes (mutual TLS). Reused when present, so that
    clients keep trusting the same CA across restarts; a server certificate of an earlier version
    (server use only) is issued again by the same CA."""
    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(ca=folder / "ca.pem", cert=folder / "server.pem", key=folder / "server-key.pem")
    ca_key_file = folder / "ca-key.pem"
    if files.ca.exists() and files.cert.exists() and files.key.exists():
        if _for_routes(files.cert) or not ca_key_file.exists():
            return files
        ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            return files
        _issue_server(files, ca, ca_key, hosts, days)
        return files
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rudder bus CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write_secret(ca_key_file, _pem_key(ca_key))
    files.ca.write_text(ca.public_bytes(serialization.Encoding.PEM).decode())
    _issue_server(files, ca, ca_key, hosts, days)
    return files


def _for_routes(cert_file: Path) -> bool:
    """Whether a server certificate may also be presented as a client (a route dialling a node)."""
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    try:
        uses = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True  # no restriction
    return x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH in uses


def _issue_server(files: TlsFiles, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                  hosts: tuple[str, ...], days: int) -> None:
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(_SERVER_USES), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_secret(files.key, _pem_key(key))
    files.cert.write_text(cert.public_bytes(serialization.Encoding.PEM).decode())
