"""vLLM's own KV-event publisher (``vllm/distributed/kv_events.py``), from pinned vLLM releases.

vLLM needs a GPU and torch to run, but its event publisher is plain Python (msgspec and
pyzmq): running it in tests replaces our reading of vLLM's wire format with vLLM's code, so a
frame format change in a newer release shows as a test failure.

- ``fetch(version)``: the release's wheel (the sdist cannot be fetched without building vLLM's
  metadata, whose setup.py imports torch) is downloaded by pip into
  ``${XDG_CACHE_HOME:-~/.cache}/llmgw/vllm-<version>/``, checked against its pinned SHA-256,
  and only the few .py files needed are extracted and kept there; the ~340 MB wheel is deleted.
  A cached copy answers at once. ``SourceUnavailable`` says why a download failed (no package
  registry, no pip): callers skip with that reason. A digest mismatch is ``SourceMismatch``, a
  failure, never a skip: the pinned release is not what was downloaded.
- ``load_kv_events(source_dir)``: imports the extracted files as ``vllm.distributed.kv_events``
  and ``vllm.config.kv_events``. What they import from the rest of vLLM is stubbed at that one
  boundary, in ``sys.modules`` (``_STUBS``); vLLM's code is never edited.
- ``load_block_hashing(source_dir)``: imports ``vllm.v1.core.kv_cache_utils`` (block hashes,
  their extra keys, ``NONE_HASH``) with the real ``vllm.utils.hashing``. That module imports
  much of vLLM (configs, KV cache specs, requests, torch helpers) for code the hashing never
  calls: each such name is a placeholder class that refuses to be instantiated
  (``_Unavailable``), found by reading the module's own imports, so a new import in a newer
  release needs no change here. ``vllm.envs`` is the one stub with a value: event hashes as
  ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, vLLM's default).

The stubs, and why each is enough:
- ``vllm.logger.init_logger``: the standard library's ``logging.getLogger``;
- ``vllm.config.utils.config``: the decorator every vLLM config class wears. vLLM's is a
  pydantic dataclass with ``extra="forbid"``, and so is this one, so an unknown key in
  ``--kv-events-config`` is refused here as vLLM refuses it;
- ``vllm.utils.network_utils`` (since 0.24): used only to bind ``tcp://*:0`` on the node's IP;
  ``get_ip`` raises (llmgw never asks for an ephemeral publisher port), the three pure helpers
  follow vLLM's;
- ``vllm.v1.core.kv_cache_utils.ExternalBlockHash``: the type alias ``bytes | int``.

This module must NOT be imported by llmgw: it is a test support module, and ``load_kv_events``
puts a fake ``vllm`` package in ``sys.modules`` (meant for a process of its own).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import ipaddress
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "NEWEST",
    "OLDER",
    "RELEASES",
    "Release",
    "SourceMismatch",
    "SourceUnavailable",
    "cache_dir",
    "fetch",
    "load_block_hashing",
    "load_kv_events",
]


@dataclass(frozen=True, slots=True)
class Release:
    version: str
    # The file pip downloads and its digest, pinned: a re-uploaded or tampered wheel fails.
    wheel: str
    sha256: str


# The newest release whose kv_events.py llmgw's relay claims to support (docs/engines.md), and
# one release with the other event encoding: up to 0.23.x events are positional tagged arrays,
# since 0.24 tagged maps; replay replies gained the topic frame in 0.26.
RELEASES = {
    r.version: r
    for r in (
        Release(
            "0.33.0",
            "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        ),
        Release(
            "0.23.0",
            "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl",
            "872aeb7c36a1ea942216af067ce870ffdf960804e829367e1b4eb36d4831c03c",
        ),
    )
}
NEWEST = "0.33.0"
OLDER = "0.23.0"

# What is extracted from the wheel and kept in the cache: the publisher and its config, and the
# block hashing (the chain and its extra keys, and the hash functions).
FILES = (
    "vllm/distributed/kv_events.py",
    "vllm/config/kv_events.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/utils/hashing.py",
)
# Written last, holding the wheel's digest: a cache dir without it is an interrupted fetch.
_STAMP = "SHA256"
_PIP_TIMEOUT_S = 900


class SourceUnavailable(Exception):
    """The release could not be downloaded (no package registry, no pip): skip, saying this."""


class SourceMismatch(Exception):
    """The downloaded wheel is not the pinned one: fail."""


def cache_dir(version: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw" / f"vllm-{version}"


def fetch(version: str, *, log: Callable[[str], None] = lambda _: None) -> Path:
    """The cache dir holding ``FILES`` of vLLM ``version``, downloading the wheel if needed."""
    release = RELEASES[version]
    target = cache_dir(version)
    if _cached(target, release):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Everything happens in a temporary sibling renamed into place at the end, so a killed
    # fetch leaves no half-extracted cache and two concurrent fetches cannot mix files.
    with tempfile.TemporaryDirectory(prefix=f".vllm-{version}-", dir=target.parent) as tmp:
        work = Path(tmp)
        log(f"downloading vLLM {version}'s wheel with pip (~340 MB, once; cached in {target})")
        wheel = _download(release, work / "wheel")
        digest = _sha256(wheel)
        if digest != release.sha256:
            raise SourceMismatch(
                f"{wheel.name}: SHA-256 {digest}, pinned {release.sha256} in "
                f"tests/support/vllm_source.py; a different file was downloaded: check it "
                f"before changing the pin"
            )
        out = work / "out"
        with zipfile.ZipFile(wheel) as zf:
            for name in FILES:
                dest = out / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(zf.read(name))
        (out / _STAMP).write_text(release.sha256 + "\n")
        shutil.rmtree(target, ignore_errors=True)
        try:
            out.rename(target)
        except OSError:
            if not _cached(target, release):  # another process won the race: keep its copy
                raise
    return target


def _cached(target: Path, release: Release) -> bool:
    stamp = target / _STAMP
    return (
        stamp.is_file()
        and stamp.read_text().strip() == release.sha256
        and all((target / name).is_file() for name in FILES)
    )


def _download(release: Release, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
        "--implementation", "cp", "--disable-pip-version-check", "--no-input", "--no-cache-dir",
        "-d", str(dest), f"vllm=={release.version}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SourceUnavailable(
            f"pip download vllm=={release.version} took over {_PIP_TIMEOUT_S} s"
        ) from exc
    if proc.returncode != 0:
        last = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        raise SourceUnavailable(
            f"pip download vllm=={release.version} failed (is a package registry reachable?): "
            + (last[-1].strip() if last else f"exit {proc.returncode}")
        )
    wheels = sorted(dest.glob("*.whl"))
    if [w.name for w in wheels] != [release.wheel]:
        raise SourceMismatch(
            f"pip downloaded {[w.name for w in wheels]} for vllm=={release.version}, pinned "
            f"{release.wheel} (tests/support/vllm_source.py)"
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- the stubbed boundary ------------------------------------------------------------------


def _config_decorator(cls: Any = None, *, config: Any = None, **kwargs: Any) -> Any:
    """vLLM's ``vllm.config.utils.config``: a pydantic dataclass forbidding extra fields."""
    from pydantic import ConfigDict
    from pydantic.dataclasses import dataclass as pydantic_dataclass

    merged = ConfigDict(extra="forbid")
    if config is not None:
        merged.update(config)

    def decorate(c: Any) -> Any:
        return pydantic_dataclass(c, config=merged, **kwargs)

    return decorate if cls is None else decorate(cls)


def _get_ip() -> str:
    raise NotImplementedError(
        "stubbed vllm.utils.network_utils.get_ip: only tcp://*:0 needs it, which llmgw's "
        "--kv-events-config never emits"
    )


def _is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def _get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if _is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port


# module name -> attributes; each a package too when it has submodules here.
_STUBS: dict[str, dict[str, Any]] = {
    "vllm": {},
    "vllm.logger": {"init_logger": logging.getLogger},
    "vllm.config": {},
    "vllm.config.utils": {"config": _config_decorator},
    "vllm.utils": {},
    "vllm.utils.network_utils": {
        "get_ip": _get_ip,
        "get_tcp_uri": _get_tcp_uri,
        "is_valid_ipv6_address": _is_valid_ipv6_address,
        "split_zmq_path": _split_zmq_path,
    },
    "vllm.v1": {},
    "vllm.v1.core": {},
    "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    "vllm.distributed": {},
}


def load_kv_events(source_dir: Path) -> types.ModuleType:
    """vLLM's ``vllm.distributed.kv_events`` from ``source_dir`` (a ``fetch`` result), its
    imports stubbed; replaces any ``vllm`` in ``sys.modules``."""
    _forget_vllm()
    for name, attrs in _STUBS.items():
        _stub(name, attrs)
    _load(source_dir, "vllm.config.kv_events")
    return _load(source_dir, "vllm.distributed.kv_events")


class _Unavailable:
    """A vLLM name the hashing module imports for code these tests never run."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"{type(self).__module__}.{type(self).__name__} is a placeholder "
            "(tests/support/vllm_source.py): the code under test should not need it"
        )


def load_block_hashing(source_dir: Path) -> types.ModuleType:
    """vLLM's ``vllm.v1.core.kv_cache_utils`` from ``source_dir``, with the real
    ``vllm.utils.hashing`` and placeholders for the rest; replaces any ``vllm`` in
    ``sys.modules``."""
    _forget_vllm()
    path = source_dir / "vllm/v1/core/kv_cache_utils.py"
    imported: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            imported.setdefault(node.module, set()).update(a.name for a in node.names)
    real = {"vllm.utils.hashing", "vllm.v1.core.kv_cache_utils"}
    values: dict[str, dict[str, Any]] = {
        "vllm": {"envs": _stub("vllm.envs", {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": True})},
        "vllm.logger": {"init_logger": logging.getLogger},
    }
    modules = set(imported) | {"vllm.v1.core"}
    for name in sorted(modules | {p for m in modules for p in _parents(m)}):
        if name in real or name == "vllm.envs":
            continue
        attrs = dict(values.get(name, {}))
        for attr in imported.get(name, ()):
            attrs.setdefault(attr, type(attr, (_Unavailable,), {"__module__": name}))
        _stub(name, attrs)
    _load(source_dir, "vllm.utils.hashing")
    return _load(source_dir, "vllm.v1.core.kv_cache_utils")


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _forget_vllm() -> None:
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def _stub(name: str, attrs: dict[str, Any]) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name, "llmgw test stub (tests/support/vllm_source.py)")
        module.__path__ = []  # a package: the real files below are found by full name
        sys.modules[name] = module
    module.__dict__.update(attrs)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_stub(parent, {}), child, module)
    return module


def _load(source_dir: Path, name: str) -> types.ModuleType:
    path = source_dir / (name.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module
