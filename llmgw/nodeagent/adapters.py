"""LoRA adapters from http(s) sources: fetched once per source, capped, checked, stored by hash.

A profile may name an adapter by URL (allowed by agent.policy.allowed_adapter_sources).
The agent downloads it before the engine starts and gives the engine the local file,
stored at `<root>/<sha256(source)>` so every shard naming the same source shares one copy
and a restarted agent does not fetch it again.

Rules, each against a way a download goes wrong on a GPU node:
- a size cap, enforced while streaming: a wrong or hostile URL must not fill the disk;
- an optional checksum, `...#sha256=<hex>` on the source: what was reviewed is what runs;
- every hop (the URL and each redirect, at most 5) must resolve to no loopback,
  link-local or cloud-metadata address: a redirect to 169.254.169.254 or to a service
  on 127.0.0.1 would hand the node's own secrets to whoever wrote the profile. Tests
  serve from 127.0.0.1 and allow loopback by a setting; link-local and metadata stay
  refused regardless. (The name is resolved again by the client when it connects; a DNS
  server that answers differently the second time is not defended against here.)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx

__all__ = ["AdapterFetchError", "adapter_path_for", "fetch_adapter", "is_url"]

_MAX_REDIRECTS = 5
_METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}


class AdapterFetchError(Exception):
    """An adapter source could not be fetched under the node's rules."""


def is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def _split_checksum(source: str) -> tuple[str, str]:
    url, _, frag = source.partition("#")
    if frag.startswith("sha256="):
        digest = frag[len("sha256=") :].lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise AdapterFetchError(f"adapter source {source!r}: #sha256= needs 64 hex digits")
        return url, digest
    return url, ""


def adapter_path_for(source: str, root: Path) -> Path:
    return root / hashlib.sha256(source.encode()).hexdigest()


async def _check_host(url: str, *, allow_loopback: bool) -> None:
    host = urlsplit(url).hostname
    if not host:
        raise AdapterFetchError(f"adapter source {url!r} has no host")
    try:
        infos = await asyncio.to_thread(socket.getaddrinfo, host, None)
    except OSError as e:
        raise AdapterFetchError(f"adapter source {url!r}: cannot resolve {host!r}: {e}") from None
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if addr in _METADATA or addr.is_link_local:
            raise AdapterFetchError(
                f"adapter source {url!r} resolves to {addr}, a link-local or cloud-metadata "
                "address; adapters are never fetched from there"
            )
        if (addr.is_loopback or addr.is_unspecified) and not allow_loopback:
            raise AdapterFetchError(
                f"adapter source {url!r} resolves to {addr} on this machine; adapters are "
                "never fetched from the node itself"
            )


async def fetch_adapter(
    source: str,
    root: Path,
    *,
    max_bytes: int,
    allow_loopback: bool = False,
    timeout_s: float = 60.0,
) -> Path:
    """The local path of the adapter behind `source`, downloading it if not yet stored."""
    url, want = _split_checksum(source)
    dest = adapter_path_for(source, root)
    if await asyncio.to_thread(dest.exists):
        return dest
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True, mode=0o700)
    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False) as c:
        for _ in range(_MAX_REDIRECTS + 1):
            if not is_url(url):
                raise AdapterFetchError(f"adapter source redirected to {url!r}, not http(s)")
            await _check_host(url, allow_loopback=allow_loopback)
            async with c.stream("GET", url) as r:
                if r.is_redirect:
                    url = urljoin(url, r.headers.get("location", ""))
                    continue
                if r.status_code != 200:
                    raise AdapterFetchError(f"adapter source {url!r} answered {r.status_code}")
                declared = int(r.headers.get("content-length") or 0)
                if declared > max_bytes:
                    raise AdapterFetchError(
                        f"adapter source {url!r} is {declared} bytes, over the "
                        f"agent.policy.adapter_max_bytes cap of {max_bytes}"
                    )
                fd, tmp = tempfile.mkstemp(prefix=".fetch-", dir=root)
                h = hashlib.sha256()
                size = 0
                try:
                    with os.fdopen(fd, "wb") as f:
                        async for chunk in r.aiter_bytes():
                            size += len(chunk)
                            if size > max_bytes:
                                raise AdapterFetchError(
                                    f"adapter source {url!r} is over the "
                                    f"agent.policy.adapter_max_bytes cap of {max_bytes}"
                                )
                            h.update(chunk)
                            f.write(chunk)
                    if want and h.hexdigest() != want:
                        raise AdapterFetchError(
                            f"adapter source {source!r}: sha256 is {h.hexdigest()}, expected {want}"
                        )
                    os.replace(tmp, dest)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                return dest
        raise AdapterFetchError(f"adapter source {source!r}: more than {_MAX_REDIRECTS} redirects")
