"""bus.tls: the bus CA and its server certificates, which routes between cluster nodes present as
clients too (mutual TLS), so they are for server and client use."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bus.tls import make_server_tls


def uses(cert: Path) -> set[x509.ObjectIdentifier]:
    c = x509.load_pem_x509_certificate(cert.read_bytes())
    return set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_server_certificates_are_for_server_and_client_use(tmp_path: Path) -> None:
    files = make_server_tls(tmp_path, hosts=("nats-1", "127.0.0.1"))
    assert uses(files.cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["nats-1"]
    assert (tmp_path / "ca-key.pem").stat().st_mode & 0o077 == 0 and files.key.stat().st_mode & 0o077 == 0
    again = make_server_tls(tmp_path, hosts=("nats-1", "127.0.0.1"))  # reused as they are
    assert again.cert.read_bytes() == files.cert.read_bytes()


def test_a_server_only_certificate_of_an_earlier_version_is_issued_again_by_the_same_ca(tmp_path: Path) -> None:
    files = make_server_tls(tmp_path)
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((tmp_path / "ca-key.pem").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    old = (x509.CertificateBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
           .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
           .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
           .sign(ca_key, hashes.SHA256()))
    files.cert.write_bytes(old.public_bytes(serialization.Encoding.PEM))
    ca_pem = files.ca.read_bytes()
    renewed = make_server_tls(tmp_path)
    assert ExtendedKeyUsageOID.CLIENT_AUTH in uses(renewed.cert)
    assert renewed.ca.read_bytes() == ca_pem  # clients keep trusting the same CA
    x509.load_pem_x509_certificate(renewed.cert.read_bytes()).verify_directly_issued_by(ca)
