"""A throwaway PKI for the TLS tests: a CA, a server certificate for 127.0.0.1 and localhost, and client
certificates, written as PEM files. Made fresh for each test run: no key material lives in the repository."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """A key and its certificate, as PEM files."""

    cert_file: Path
    key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, key, cert: x509.Certificate) -> Issued:
    cert_file, key_file = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Issued(cert_file, key_file)


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates (P-256 keys: quick to make)."""

    def __init__(self, directory: Path, name: str = "audio-pipeline test CA"):
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        stem = name.replace(" ", "-")
        self.files = _write(directory, stem, self.key, self.cert)

    @property
    def cert_file(self) -> Path:
        return self.files.cert_file

    def issue(self, stem: str, common_name: str, *, server: bool) -> Issued:
        """A leaf certificate; a server one names 127.0.0.1 and localhost (what clients check)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(
                       [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return _write(self.directory, stem, key, builder.sign(self.key, hashes.SHA256()))
