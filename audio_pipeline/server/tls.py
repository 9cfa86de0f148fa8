"""Server TLS from PEM files: the server's certificate and key, and optionally a CA that client
certificates must be signed by (mutual TLS). Read once at start-up, so a wrong path fails before the
model loads rather than on the first connection."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    """Paths as given on the command line (``--tls-cert-file`` and friends); None = not given."""

    cert_file: str | None = None
    key_file: str | None = None
    #: When set, clients must present a certificate signed by this CA (mutual TLS).
    client_ca_file: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.key_file or self.client_ca_file)


def _read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    # A key or certificate in DER or an empty file would only fail later, inside grpc, without naming the file.
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def _check_usable(files: TLSFiles) -> None:
    """Loads the files with the standard library's TLS, which names what is wrong; grpc itself only
    fails to bind the port ("Failed to bind"), after the model has loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key is refused (grpc cannot take a password): b"" never decrypts one.
        context.load_cert_chain(files.cert_file, files.key_file, password=b"")
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ValueError(f"--tls-key-file: {files.key_file} is not the private key of the certificate in "
                             f"{files.cert_file}") from None
        raise ValueError(f"--tls-cert-file/--tls-key-file: cannot use {files.cert_file} with {files.key_file} "
                         f"({exc.reason or exc}): give a PEM certificate and its unencrypted PEM private key") from None
    if files.client_ca_file:
        try:
            context.load_verify_locations(cafile=files.client_ca_file)
        except ssl.SSLError as exc:
            raise ValueError(f"--tls-client-ca-file: {files.client_ca_file} holds no usable CA certificate "
                             f"({exc.reason or exc})") from None


def server_credentials(files: TLSFiles | None) -> grpc.ServerCredentials | None:
    """TLS credentials for ``add_secure_port``, or None when no TLS flag was given (plaintext).

    ValueError naming the flag when only one of certificate and key is given, or a file cannot be read.
    """
    if files is None or not files.enabled:
        return None
    flags = {"--tls-cert-file": files.cert_file, "--tls-key-file": files.key_file,
             "--tls-client-ca-file": files.client_ca_file}
    missing = [flag for flag in ("--tls-cert-file", "--tls-key-file") if not flags[flag]]
    if missing:
        given = next(flag for flag, path in flags.items() if path)
        raise ValueError(f"{given} needs {' and '.join(missing)}: TLS takes both the server certificate and "
                         "its private key")
    cert = _read_pem(files.cert_file, "--tls-cert-file")
    key = _read_pem(files.key_file, "--tls-key-file")
    client_ca = _read_pem(files.client_ca_file, "--tls-client-ca-file") if files.client_ca_file else None
    _check_usable(files)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def http_ssl_options(files: TLSFiles | None) -> dict:
    """uvicorn's TLS settings for the HTTP front door: the same certificate, key and client CA as
    gRPC's (mutual TLS too); {} for plaintext. Call after server_credentials() checked the files."""
    if files is None or not files.enabled:
        return {}
    options = {"ssl_certfile": files.cert_file, "ssl_keyfile": files.key_file}
    if files.client_ca_file:
        options.update(ssl_ca_certs=files.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
