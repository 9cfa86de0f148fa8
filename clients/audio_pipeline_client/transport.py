"""What the sync and async clients share about the connection: channel set-up, retries, deadlines, health."""

from __future__ import annotations

import ipaddress
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from audio_pipeline_client._proto import tts_pb2
from audio_pipeline_client.types import TTSError

TTS_SERVICE_NAME = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_SERVING = 1
HEALTH_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
INITIAL_BACKOFF_SECONDS = 0.2
HEALTH_POLL_SECONDS = 0.1
USER_AGENT = "audio-pipeline-client/0.1.0"

TLSOption = bool | bytes | str | os.PathLike


PEMOption = bytes | str | os.PathLike


def _pem(value: PEMOption) -> bytes:
    return value if isinstance(value, bytes) else Path(value).read_bytes()


def channel_credentials(tls: TLSOption, client_cert: PEMOption | None = None,
                        client_key: PEMOption | None = None) -> grpc.ChannelCredentials | None:
    """None for plaintext; TLS with the system roots (True) or with given root certificates (bytes or a
    path). ``client_cert`` and ``client_key`` (PEM bytes or paths, both or neither) present a client
    certificate, for servers that ask for one (mutual TLS)."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together: give both or neither")
    if tls is False or tls is None:
        if client_cert is not None:
            raise ValueError("a client certificate needs TLS: set tls (True or the CA's certificates)")
        return None
    roots = None if tls is True else _pem(tls)
    if client_cert is None:
        return grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=_pem(client_key),
                                        certificate_chain=_pem(client_cert))


#: Load-balancing policies a client may pick (gRPC's own).
LOAD_BALANCING_POLICIES = ("round_robin", "pick_first")
#: The calls that retry UNAVAILABLE on another replica: those that change nothing on the server.
#: gRPC commits a call (stops retrying it) once the first response message arrives; for
#: Synthesize that is the stream's format message, sent when the server has accepted the request.
RETRIED_METHODS = ("Synthesize", "ListVoices")
#: gRPC allows at most 5 attempts of a call.
MAX_ATTEMPTS = 5

TargetOption = str | Sequence[str]


def grpc_target(target: TargetOption) -> str:
    """One gRPC target for one server or a set of replicas.

    A string is used as it is: ``host:port``, or a name gRPC resolves to every replica
    (``dns:///tts.example.svc:50051``, a headless Kubernetes service). A list of ``ip:port``
    addresses becomes gRPC's static address list (``ipv4:a:p,b:p``); gRPC resolves a list of names
    only through DNS, so a list must hold addresses (give one ``dns:///`` name for names)."""
    if isinstance(target, str):
        if not target:
            raise ValueError("target: give host:port, a dns:/// name or a list of ip:port addresses")
        return target
    targets = list(target)
    if not targets:
        raise ValueError("target: the list of replicas is empty")
    if len(targets) == 1:
        return targets[0]
    families, addresses = set(), []
    for item in targets:
        host, _, port = item.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"target: {item!r} in a list of replicas must be ip:port (gRPC resolves names "
                             "only through DNS: give one dns:///name:port target instead)") from None
        if not port.isdigit():
            raise ValueError(f"target: {item!r} has no port")
        families.add(address.version)
        addresses.append(f"[{host}]:{port}" if address.version == 6 else f"{host}:{port}")
    if len(families) > 1:
        raise ValueError("target: a list of replicas is all IPv4 or all IPv6 (gRPC's address lists)")
    return f"ipv{families.pop()}:" + ",".join(addresses)


#: What a client retries by default: a replica warming up, draining, stopped or unreachable.
RETRY_CODES = ("UNAVAILABLE",)


def service_config(retries: int, load_balancing: str = "round_robin", retry_codes: Sequence[str] = RETRY_CODES) -> str:
    """The channel's gRPC service config: the load-balancing policy, and a retry policy that sends
    a call refused with UNAVAILABLE (a replica warming up, draining, stopped or unreachable) to the
    next replica with exponential backoff (0.2 s, 0.4 s, 0.8 s, ... with gRPC's jitter). Every
    other code is an answer a retry would repeat, unless ``retry_codes`` names it (behind Ray
    Serve's proxy add INTERNAL: it reports a replica that died as INTERNAL). The server sends
    nothing before a stream's first audio, so no call is retried once audio has arrived. The
    call's deadline covers all its attempts."""
    if load_balancing not in LOAD_BALANCING_POLICIES:
        raise ValueError(f"load_balancing: {load_balancing!r} is not one of {', '.join(LOAD_BALANCING_POLICIES)}")
    if retries < 0:
        raise ValueError("retries: must be 0 or more")
    codes = [str(code).upper() for code in retry_codes]
    unknown = [code for code in codes if code not in grpc.StatusCode.__members__ or code == "OK"]
    if unknown:
        raise ValueError(f"retry_codes: {', '.join(unknown)} is not a gRPC status code name")
    config: dict = {"loadBalancingConfig": [{load_balancing: {}}]}
    if retries:
        config["methodConfig"] = [{
            "name": [{"service": TTS_SERVICE_NAME, "method": method} for method in RETRIED_METHODS],
            "retryPolicy": {"maxAttempts": min(retries + 1, MAX_ATTEMPTS), "initialBackoff": f"{INITIAL_BACKOFF_SECONDS}s",
                            "maxBackoff": "5s", "backoffMultiplier": 2, "retryableStatusCodes": codes},
        }]
    return json.dumps(config)


def channel_options(options: Mapping[str, object] | Sequence[tuple[str, object]] | None, *, retries: int = 3,
                    load_balancing: str = "round_robin",
                    retry_codes: Sequence[str] = RETRY_CODES) -> list[tuple[str, object]]:
    """grpc channel arguments from a mapping or pairs, with this library's user agent and service
    config (load balancing, retries) unless the caller gives their own."""
    pairs = list(options.items()) if isinstance(options, Mapping) else list(options or ())
    if not any(key == "grpc.primary_user_agent" for key, _ in pairs):
        pairs.append(("grpc.primary_user_agent", USER_AGENT))
    if not any(key == "grpc.service_config" for key, _ in pairs):
        pairs.append(("grpc.service_config", service_config(retries, load_balancing, retry_codes)))
    pairs.append(("grpc.enable_retries", 1 if retries else 0))
    return pairs


def call_metadata(token: str | None, extra: Sequence[tuple[str, str]] | None = None) -> tuple[tuple[str, str], ...] | None:
    """Metadata sent with every call: the bearer token and the caller's own pairs (for example
    ``("application", "tts")``, which a Ray Serve gRPC proxy routes on)."""
    pairs = tuple(extra or ()) + ((("authorization", f"Bearer {token}"),) if token else ())
    return pairs or None


class Deadline:
    """The one deadline of a call across its retries (None: no deadline)."""

    def __init__(self, timeout: float | None):
        self.expires = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.expires is None else max(0.0, self.expires - time.monotonic())


def encode_health_request(service: str) -> bytes:
    """A grpc.health.v1.HealthCheckRequest (field 1: service name), encoded by hand.

    The client library does not depend on grpcio-health-checking; the message is one string field.
    """
    name = service.encode()
    return b"\x0a" + _encode_varint(len(name)) + name if name else b""


def decode_health_status(data: bytes) -> int:
    """The ``status`` (field 1, an enum) of an encoded grpc.health.v1.HealthCheckResponse; 0 when absent."""
    status = 0
    position = 0
    while position < len(data):
        key, position = _decode_varint(data, position)
        field_number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _decode_varint(data, position)
            if field_number == 1:
                status = value
        elif wire_type == 2:
            length, position = _decode_varint(data, position)
            position += length
        elif wire_type in (1, 5):
            position += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
    if position > len(data):
        raise ValueError("truncated health check response")
    return status


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _decode_varint(data: bytes, position: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if position >= len(data):
            raise ValueError("truncated varint in health check response")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
    raise ValueError("varint too long in health check response")


class ReadinessProbe:
    """The state of one ``wait_ready``: which service to ask about, what it said last, when to give up.

    It asks about the TextToSpeech service, and about the whole server ("") if the health service
    does not know that name. The sync and async clients drive it with their own calls and sleeps.
    """

    def __init__(self, target: str, timeout: float):
        self.target = target
        self.timeout = timeout
        self.deadline = Deadline(timeout)
        self.service = TTS_SERVICE_NAME
        self.last_answer = "no answer"

    def request(self) -> bytes:
        return encode_health_request(self.service)

    def ready(self, reply: bytes) -> bool:
        status = decode_health_status(reply)
        self.last_answer = HEALTH_STATUS_NAMES.get(status, f"status {status}")
        return status == HEALTH_SERVING

    def failed(self, error: grpc.RpcError) -> None:
        """Notes a failed check; raises TTSError when waiting longer cannot help."""
        code = error.code()
        if code == grpc.StatusCode.NOT_FOUND and self.service:
            self.service = ""
            return
        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED):
            raise TTSError(code, f"health check of {self.target} failed: {error.details() or ''}")
        self.last_answer = str(TTSError.from_rpc_error(error))

    def next_wait(self) -> float:
        """Seconds to sleep before the next check; raises TTSError (DEADLINE_EXCEEDED) once out of time."""
        remaining = self.deadline.remaining()
        if remaining <= 0:
            raise TTSError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"{self.target} not ready after {self.timeout:g} s (last answer: {self.last_answer})")
        return min(HEALTH_POLL_SECONDS, remaining)
