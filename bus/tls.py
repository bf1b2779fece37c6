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


def make_server_tls(folder: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                    days: int = 825) -> TlsFiles:
    """A CA and one server certificate for ``hosts`` (IP addresses or DNS names), reused when
    present so that clients keep trusting the same CA across restarts."""
    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(ca=folder / "ca.pem", cert=folder / "server.pem", key=folder / "server-key.pem")
    if files.ca.exists() and files.cert.exists() and files.key.exists():
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
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_secret(folder / "ca-key.pem", _pem_key(ca_key))
    write_secret(files.key, _pem_key(key))
    files.cert.write_text(cert.public_bytes(serialization.Encoding.PEM).decode())
    files.ca.write_text(ca.public_bytes(serialization.Encoding.PEM).decode())
    return files
