"""The devcluster's certificates: one CA signs every serving and client certificate.

Keys are ECDSA P-256 (generating RSA keys costs seconds on this 2-core machine; Kubernetes accepts
ECDSA everywhere, including ES256 service-account tokens). Files are created once and reused, so the
admin kubeconfig stays valid across `down`/`up`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_VALIDITY = datetime.timedelta(days=3650)
LEAF_VALIDITY = datetime.timedelta(days=365)
# Certificates start an hour in the past so a slightly skewed clock never sees them as not-yet-valid.
CLOCK_SKEW = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class CertKey:
    cert: Path
    key: Path


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def ensure_ca(pki: Path, stem: str = "ca", common_name: str = "dtjob-devcluster-ca") -> CertKey:
    """A CA at pki/<stem>.crt, pki/<stem>.key (created on first use); the default is the cluster CA."""
    ca = CertKey(pki / f"{stem}.crt", pki / f"{stem}.key")
    if ca.cert.exists() and ca.key.exists():
        return ca
    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(ca.key, _key_pem(key))
    _write_public(ca.cert, cert.public_bytes(serialization.Encoding.PEM))
    return ca


def ensure_cert(
    ca: CertKey,
    out: CertKey,
    common_name: str,
    organizations: tuple[str, ...] = (),
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    server: bool = False,
    client: bool = False,
) -> CertKey:
    """A leaf certificate signed by `ca`, written to out.cert/out.key unless both already exist."""
    if out.cert.exists() and out.key.exists():
        return out
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{ca.key} is not an ECDSA key")
    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + LEAF_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if dns_names or ip_addresses:
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_private(out.key, _key_pem(key))
    _write_public(out.cert, cert.public_bytes(serialization.Encoding.PEM))
    return out


def ensure_service_account_keys(pki: Path) -> CertKey:
    """The key pair that signs service-account tokens (`cert` holds the public key, PEM)."""
    pair = CertKey(pki / "sa.pub", pki / "sa.key")
    if pair.cert.exists() and pair.key.exists():
        return pair
    key = _new_key()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_private(pair.key, _key_pem(key))
    _write_public(pair.cert, public)
    return pair


def write_kubeconfig(path: Path, server: str, ca_cert: Path, client: CertKey, user: str) -> None:
    """A kubeconfig with one cluster/user/context; certificates are referenced by absolute path so
    every client (kubectl, client-go, Python's ssl) reads the same files."""
    text = f"""apiVersion: v1
kind: Config
clusters:
- name: dtjob
  cluster:
    server: {server}
    certificate-authority: {ca_cert.absolute()}
users:
- name: {user}
  user:
    client-certificate: {client.cert.absolute()}
    client-key: {client.key.absolute()}
contexts:
- name: dtjob
  context:
    cluster: dtjob
    user: {user}
current-context: dtjob
"""
    _write_private(path, text.encode())
