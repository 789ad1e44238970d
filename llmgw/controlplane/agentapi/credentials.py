"""The agent API's two secrets: bootstrap tokens and node credentials, and how they are checked.

    bootstrap token   llmgwb_<id>_<secret>        lets a new node register (design §5)
    node credential   llmgwn_<node uuid>_<secret> what a registered node's agent presents

Only SHA-256 of the secret is stored. A fast hash is right here, as for API keys: the secrets
are 256 random bits, so there is nothing to brute-force, and node credentials are checked on
every sync and KV request. The id travels in the clear inside the token so the row is found
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
    "NODE_PREFIX",
    "BootstrapToken",
    "NodeCredential",
    "bearer_credential",
    "hash_matches",
    "new_bootstrap_token",
    "new_node_credential",
    "parse_bootstrap_token",
    "parse_node_credential",
    "secret_sha256",
]

BOOTSTRAP_PREFIX = "llmgwb"
NODE_PREFIX = "llmgwn"
# Bootstrap token ids: short hex, no underscore, so the token splits unambiguously.
_BOOTSTRAP_ID_BYTES = 8
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
        id=secrets.token_hex(_BOOTSTRAP_ID_BYTES), secret=secrets.token_urlsafe(_SECRET_BYTES)
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


def parse_bootstrap_token(text: str) -> BootstrapToken | None:
    """The token's parts, or None for anything not shaped ``llmgwb_<id>_<secret>``."""
    parts = _split(text.strip(), BOOTSTRAP_PREFIX)
    if parts is None or len(parts[0]) > 32:
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
