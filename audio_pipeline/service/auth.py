"""Bearer tokens: which tokens the server accepts, and the role each grants (client or admin).

Tokens come from files (``--auth-token-file``, ``--admin-token-file``: one token a line, blank lines
and ``#`` comments ignored) and from the environment (``AUDIO_PIPELINE_AUTH_TOKENS``,
``AUDIO_PIPELINE_ADMIN_TOKENS``: comma-separated); a server accepts the union of both sources. Each
front door applies them to its own protocol (server/auth.py for gRPC, http/app.py for HTTP and
the WebSocket). Presented tokens are compared with every configured one in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

AUTH_TOKENS_ENVIRONMENT = "AUDIO_PIPELINE_AUTH_TOKENS"
ADMIN_TOKENS_ENVIRONMENT = "AUDIO_PIPELINE_ADMIN_TOKENS"


class Role(Enum):
    CLIENT = "client"
    ADMIN = "admin"


def parse_tokens(lines: Iterable[str], source: str) -> list[str]:
    """Tokens of a file or variable; ValueError naming ``source`` and the line (never the token)."""
    tokens = []
    for number, line in enumerate(lines, 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        # A token travels as a gRPC metadata value: visible ASCII only, and no spaces inside it.
        if not all("!" <= ch <= "~" for ch in token):
            raise ValueError(f"{source}: token {number} has characters other than visible ASCII")
        tokens.append(token)
    return tokens


def load_tokens(file: str | None, environment_value: str | None, *, flag: str, variable: str) -> frozenset[str]:
    """The union of the tokens of ``file`` and of the comma-separated ``environment_value``.

    A file given but holding no token is an error: it would leave the server open by mistake.
    """
    tokens: list[str] = []
    if file:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"{flag}: cannot read {file}: {reason or exc}") from None
        from_file = parse_tokens(text.splitlines(), f"{flag} {file}")
        if not from_file:
            raise ValueError(f"{flag}: {file} holds no token (one a line; '#' starts a comment)")
        tokens += from_file
    if environment_value:
        tokens += parse_tokens(environment_value.split(","), f"environment variable {variable}")
    return frozenset(tokens)


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps compare_digest's time independent of the token's length too.
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class AuthTokens:
    """The accepted tokens; both empty = no authentication."""

    client: frozenset[str] = frozenset()
    admin: frozenset[str] = frozenset()

    @classmethod
    def load(cls, token_file: str | None = None, admin_token_file: str | None = None,
             environ: Mapping[str, str] | None = None) -> AuthTokens:
        environ = os.environ if environ is None else environ
        return cls(load_tokens(token_file, environ.get(AUTH_TOKENS_ENVIRONMENT), flag="--auth-token-file",
                               variable=AUTH_TOKENS_ENVIRONMENT),
                   load_tokens(admin_token_file, environ.get(ADMIN_TOKENS_ENVIRONMENT), flag="--admin-token-file",
                               variable=ADMIN_TOKENS_ENVIRONMENT))

    @property
    def enabled(self) -> bool:
        return bool(self.client or self.admin)

    def role_of(self, presented: str) -> Role | None:
        """The role ``presented`` grants, None when it is no configured token.

        Every configured token is compared (no early exit), so the time taken does not tell which
        token, or how many, came close.
        """
        digest = _digest(presented)
        is_admin = False
        is_client = False
        for token in self.admin:
            is_admin |= hmac.compare_digest(_digest(token), digest)
        for token in self.client:
            is_client |= hmac.compare_digest(_digest(token), digest)
        if is_admin:
            return Role.ADMIN
        return Role.CLIENT if is_client else None


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry; None when there is none."""
    for key, value in metadata or ():
        if key != "authorization" or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None
