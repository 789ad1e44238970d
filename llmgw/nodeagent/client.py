"""The agent's HTTP client for the control plane's agent API (llmgw.protocol).

TLS with certificate verification on every connection that leaves the
machine; plain http only to loopback, or with the explicit
`allow_insecure_http` setting (docs/architecture.md §5): a node credential sent in clear
text on a network lets anyone who sees it report as this node. ``check_url`` is that rule,
for every URL the agent sends its credential to: the sync client's, and each control plane
instance's the KV relay posts to (nodeagent/kvrelay/relay.py).

Failures are sorted so the sync loop knows what it may retry:

    ControlPlaneError
     ├── Unreachable    transport error, timeout, 5xx, 429: retry with backoff, change nothing
     ├── Refused        401/403: the token or credential is wrong or revoked
     └── Incompatible   any other 4xx, or a body that does not parse
"""

from __future__ import annotations

import ipaddress
from typing import TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from llmgw.errors import ConfigError
from llmgw.protocol import (
    REGISTER_PATH,
    SYNC_PATH,
    ProtocolErrorBody,
    RegisterRequest,
    RegisterResponse,
    SyncRequest,
    SyncResponse,
)
from llmgw.protocol.tokenizers import (
    TOKENIZER_PATH,
    TokenizerUpload,
    TokenizerUploadResponse,
)

__all__ = [
    "MAX_RESPONSE_BYTES",
    "ControlPlaneClient",
    "ControlPlaneError",
    "Incompatible",
    "Refused",
    "Unreachable",
    "check_url",
    "is_loopback_host",
]

# A sync answer holds at most MAX_SHARDS specs; this is far above that and
# far below what would hurt the node.
MAX_RESPONSE_BYTES = 32 << 20

M = TypeVar("M", bound=BaseModel)


class ControlPlaneError(Exception):
    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Unreachable(ControlPlaneError):
    pass


class Refused(ControlPlaneError):
    pass


class Incompatible(ControlPlaneError):
    pass


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_url(
    url: str, *, allow_insecure_http: bool, setting: str = "agent.controlplane_url"
) -> str:
    """The URL without a trailing slash, or ConfigError when it breaks the TLS rule.

    ``setting``: where the URL comes from, named in the error (the agent's own setting, or
    ``controlplane.advertise_url`` for an instance's URL a sync response carried)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"control plane URL {url!r} ({setting}) is not an http(s) URL with a host; set "
            "it to e.g. https://cp.internal:8081",
            field=setting,
        )
    if parts.scheme == "http" and not is_loopback_host(parts.hostname) and not allow_insecure_http:
        raise ConfigError(
            f"control plane URL {url!r} ({setting}) is plain http to a host off this machine: "
            "the node credential would cross the network in clear text. Set it to an "
            "https:// URL, or set agent.allow_insecure_http = true on a network you trust",
            field=setting,
        )
    return url.rstrip("/")


class ControlPlaneClient:
    def __init__(
        self,
        url: str,
        *,
        ca_file: str = "",
        allow_insecure_http: bool = False,
        timeout_s: float = 10.0,
    ) -> None:
        self.url = check_url(url, allow_insecure_http=allow_insecure_http)
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=timeout_s,
            verify=ca_file or True,
            # Proxies from the environment would see the credential.
            trust_env=False,
            follow_redirects=False,
        )

    async def _post(
        self, path: str, body: BaseModel, response: type[M], *, credential: str = ""
    ) -> M:
        headers = {"Content-Type": "application/json"}
        if credential:
            headers["Authorization"] = f"Bearer {credential}"
        try:
            async with self._client.stream(
                "POST", path, content=body.model_dump_json().encode(), headers=headers
            ) as r:
                chunks: list[bytes] = []
                size = 0
                async for chunk in r.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_RESPONSE_BYTES:
                        raise Incompatible(
                            f"{path}: answer larger than {MAX_RESPONSE_BYTES} bytes",
                            status=r.status_code,
                        )
                    chunks.append(chunk)
                status = r.status_code
        except httpx.HTTPError as e:
            raise Unreachable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        data = b"".join(chunks)
        if status >= 300:
            detail = _error_detail(data)
            msg = f"{self.url}{path} answered {status}{': ' + detail if detail else ''}"
            if status in (401, 403):
                raise Refused(msg, status=status)
            if status >= 500 or status in (408, 429):
                raise Unreachable(msg, status=status)
            raise Incompatible(msg, status=status)
        try:
            return response.model_validate_json(data)
        except ValidationError as e:
            raise Incompatible(
                f"{self.url}{path}: answer does not parse as {response.__name__}: "
                f"{e.errors()[0]['loc']}: {e.errors()[0]['msg']}",
                status=status,
            ) from None

    async def register(self, request: RegisterRequest) -> RegisterResponse:
        return await self._post(REGISTER_PATH, request, RegisterResponse)

    async def sync(self, request: SyncRequest, *, credential: str) -> SyncResponse:
        return await self._post(SYNC_PATH, request, SyncResponse, credential=credential)

    async def upload_tokenizer(
        self, request: TokenizerUpload, *, credential: str
    ) -> TokenizerUploadResponse:
        return await self._post(
            TOKENIZER_PATH, request, TokenizerUploadResponse, credential=credential
        )

    async def close(self) -> None:
        await self._client.aclose()


def _error_detail(data: bytes) -> str:
    try:
        body = ProtocolErrorBody.model_validate_json(data)
    except ValidationError:
        return ""
    return f"{body.code}: {body.message}"[:300]
