"""A throwaway certificate authority for the Kubernetes emulator.

The emulated API server is HTTPS with a certificate from a fresh CA, and the CA goes into
the kubeconfig it writes — so every test and ``wsync demo`` exercises real TLS
verification (a client that skipped it would also accept a stranger's server).  The
CA also signs a client certificate, for the kubeconfig user that authenticates by
certificate.  Keys are EC P-256: quick to generate on a loaded machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Issued:
    """One certificate and its private key, PEM."""

    cert_pem: bytes
    key_pem: bytes


def _name(common: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class ThrowawayCA:
    """A CA that lives as long as the emulator: issues server and client certificates."""

    def __init__(
        self,
        common_name: str = "wsync-emulator-ca",
        *,
        issuer: ThrowawayCA | None = None,
        path_length: int = 0,
    ) -> None:
        """A root CA, or with ``issuer`` an intermediate one it signs (whose own
        ``path_length`` must then be 1 or more)."""
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._name = _name(common_name)
        signer = issuer or self
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(signer._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(signer._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self, common: str, *, org: str | None = None, ip: str | None = None, server: bool
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common, org))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            names: list[x509.GeneralName] = [x509.DNSName("localhost")]
            if ip:
                names.append(x509.IPAddress(ipaddress.ip_address(ip)))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))
