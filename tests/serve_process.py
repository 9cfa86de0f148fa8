"""Test helpers for `audio-pipeline serve` run as a real subprocess: its port, and its readiness."""

from __future__ import annotations

import re
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc


def listening_port(server) -> int:
    """The port from the server's 'listening on 127.0.0.1:PORT' line (``server``: a Popen whose stderr
    is a text pipe, read up to that line)."""
    for line in server.stderr:
        if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
            return int(match.group(1))
    raise AssertionError("the server never printed its port")


def wait_serving(channel, timeout: float = 120) -> None:
    """Waits until the standard health service on ``channel`` reports SERVING."""
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "never became SERVING"
        time.sleep(0.1)
