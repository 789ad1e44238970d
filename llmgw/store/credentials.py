"""The control plane's three secrets, their shapes, and how they are checked.

    API key           llmgw_<id>_<secret>         what clients of the gateway send
    bootstrap token   llmgwb_<id>_<secret>        lets a new node register (docs/architecture.md §5)
    node credential   llmgwn_<node uuid>_<secret> what a registered node's agent presents

Only SHA-256 of the secret is stored. A fast hash is right here: the secrets are 256 random
bits, so there is nothing to brute-force, and API keys and node credentials are checked on
every request. The id travels in the clear inside the token so the row is found
by primary key; the comparison of hashes is in constant time, because a byte-by-byte one
leaks how much of a guess was right.

Pure: no I/O. This module must never log or put a secret into an exception message.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass

__all__ = [
    "BOOTSTRAP_PREFIX",
    "KEY_PREFIX",
    "NODE_PREFIX",
    "BootstrapToken",
    "NewApiKey",
    "NodeCredential",
    "bearer_credential",
    "hash_matches",
    "new_api_key",
    "new_bootstrap_token",
    "new_node_credential",
    "parse_api_key",
    "parse_bootstrap_token",
    "parse_node_credential",
    "secret_sha256",
]

KEY_PREFIX = "llmgw"
BOOTSTRAP_PREFIX = "llmgwb"
NODE_PREFIX = "llmgwn"
# API key and bootstrap token ids: short hex, no underscore, so the secret splits unambiguously.
_ID_BYTES = 8
_MAX_ID_CHARS = 32
_SECRET_BYTES = 32
# token_urlsafe(32) is 43 characters; anything much longer is not ours and is not hashed.
_MAX_SECRET_CHARS = 128


def secret_sha256(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def hash_matches(secret: str, stored: bytes | None) -> bool:
    """Whether ``secret`` hashes to ``stored``, compared in constant time; False for no hash."""
    if not stored:
        return False
    return hmac.compare_digest(secret_sha256(secret), stored)


@dataclass(frozen=True, slots=True)
class BootstrapToken:
    id: str
    secret: str

    @property
    def plaintext(self) -> str:
        return f"{BOOTSTRAP_PREFIX}_{self.id}_{self.secret}"

    def __repr__(self) -> str:  # the secret must never reach a log line
        return f"BootstrapToken(id={self.id!r})"


@dataclass(frozen=True, slots=True)
class NodeCredential:
    node_id: uuid.UUID
    secret: str

    @property
    def plaintext(self) -> str:
        return f"{NODE_PREFIX}_{self.node_id}_{self.secret}"

    def __repr__(self) -> str:
        return f"NodeCredential(node_id={self.node_id!r})"


def new_bootstrap_token() -> BootstrapToken:
    return BootstrapToken(
        id=secrets.token_hex(_ID_BYTES), secret=secrets.token_urlsafe(_SECRET_BYTES)
    )


def new_node_credential(node_id: uuid.UUID) -> NodeCredential:
    return NodeCredential(node_id=node_id, secret=secrets.token_urlsafe(_SECRET_BYTES))


def _split(text: str, prefix: str) -> tuple[str, str] | None:
    # The secret is base64url and may itself contain "_": split off the prefix and id only.
    head, sep, rest = text.partition("_")
    if head != prefix or not sep:
        return None
    ident, sep, secret = rest.partition("_")
    if not ident or not sep or not secret or len(secret) > _MAX_SECRET_CHARS:
        return None
    return ident, secret


@dataclass(frozen=True, slots=True)
class NewApiKey:
    id: str
    secret: str

    @property
    def plaintext(self) -> str:
        return f"{KEY_PREFIX}_{self.id}_{self.secret}"

    @property
    def secret_sha256(self) -> bytes:
        return secret_sha256(self.secret)

    def __repr__(self) -> str:  # the secret must never reach a log line
        return f"NewApiKey(id={self.id!r})"


def new_api_key() -> NewApiKey:
    return NewApiKey(id=secrets.token_hex(_ID_BYTES), secret=secrets.token_urlsafe(_SECRET_BYTES))


def parse_api_key(authorization: str | None) -> tuple[str, str] | None:
    """(id, secret) of an ``Authorization: Bearer llmgw_<id>_<secret>`` header, or None."""
    scheme, _, value = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    parts = _split(value.strip(), KEY_PREFIX)
    if parts is None or len(parts[0]) > _MAX_ID_CHARS:
        return None
    return parts


def parse_bootstrap_token(text: str) -> BootstrapToken | None:
    """The token's parts, or None for anything not shaped ``llmgwb_<id>_<secret>``."""
    parts = _split(text.strip(), BOOTSTRAP_PREFIX)
    if parts is None or len(parts[0]) > _MAX_ID_CHARS:
        return None
    return BootstrapToken(id=parts[0], secret=parts[1])


def parse_node_credential(text: str) -> NodeCredential | None:
    """The credential's parts, or None for anything not shaped ``llmgwn_<uuid>_<secret>``."""
    parts = _split(text.strip(), NODE_PREFIX)
    if parts is None:
        return None
    try:
        node_id = uuid.UUID(parts[0])
    except ValueError:
        return None
    return NodeCredential(node_id=node_id, secret=parts[1])


def bearer_credential(authorization: str | None) -> NodeCredential | None:
    """The node credential of an ``Authorization: Bearer ...`` header, or None."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return parse_node_credential(value)
