"""Shipping each ready shard's model tokenizer files to the control plane, once.

The control plane usually does not hold the model; the gateways tokenize prompts locally with
the model's own tokenizer files, so the agent reads them from the model directory on its node
when a rank-0 shard first becomes ready and POSTs them (``protocol.tokenizers``). Which
directory: the engine's ``--tokenizer`` argument where the profile passes one (vLLM and the
simulator both take it; the simulator's ``tiny``, its adapter's default, is the packaged tiny
model and ``builtin`` its constructed vocabulary, which has no files), else the profile's
``model_path`` when it is a directory on this node holding a ``tokenizer.json``.
A model with neither (a GGUF file, a hub name not on disk) ships nothing, and the gateways
fall back to a replica's ``/tokenize``.

Read: the named files only (``TOKENIZER_FILE_NAMES``), each capped, off the event loop.
Shipped once per shard and set of files (a restart of the same engine ships nothing new; the
control plane answers an unchanged set with ``changed: false`` anyway); a failed upload is
retried on a later pass, at most every ``retry_s``.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from llmgw.errors import LlmgwError
from llmgw.kv.hf_tokenizer import MAX_FILE_BYTES, TOKENIZER_FILE_NAMES, TokenizerFiles
from llmgw.logs import get_logger
from llmgw.protocol.tokenizers import TokenizerUpload

__all__ = ["TokenizerShipper", "read_tokenizer_files", "tokenizer_dir"]

log = get_logger("llmgw.nodeagent")

Upload = Callable[[TokenizerUpload], Any]


def tokenizer_dir(spec: Mapping[str, Any]) -> Path | None:
    """The model directory whose tokenizer files a shard's engine uses, from its launch spec."""
    profile = spec.get("profile") if isinstance(spec.get("profile"), dict) else {}
    assert isinstance(profile, dict)
    args = [str(a) for a in profile.get("args") or ()]
    named: str | None = None
    for i, arg in enumerate(args):
        if arg == "--tokenizer" and i + 1 < len(args):
            named = args[i + 1]
        elif arg.startswith("--tokenizer="):
            named = arg.partition("=")[2]
    if str(profile.get("engine", "")) == "sim":
        # The sim adapter passes `--tokenizer tiny` unless the profile names one (its
        # model_path is sim://..., never a directory); `builtin` is the constructed vocabulary.
        if named is None or named == "tiny":
            return Path(str(resources.files("llmgw") / "tinymodel"))
        if named == "builtin":
            return None
    candidate = Path(named) if named else Path(str(profile.get("model_path") or ""))
    if str(candidate) and candidate.is_dir() and (candidate / "tokenizer.json").is_file():
        return candidate
    return None


def read_tokenizer_files(directory: Path) -> TokenizerFiles:
    files: dict[str, bytes] = {}
    for name in TOKENIZER_FILE_NAMES:
        path = directory / name
        if path.is_file():
            if path.stat().st_size > MAX_FILE_BYTES:
                raise LlmgwError(f"{path} is over the cap of {MAX_FILE_BYTES} bytes")
            files[name] = path.read_bytes()
    return TokenizerFiles(files)


class TokenizerShipper:
    def __init__(self, upload: Upload, *, retry_s: float = 30.0) -> None:
        self._upload = upload
        self._retry_s = retry_s
        self._shipped: dict[str, str] = {}  # shard -> digest shipped
        self._tried: dict[str, float] = {}  # shard -> when an upload last failed
        self._task: asyncio.Task[None] | None = None

    def ready(self, shards: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        """The ready rank-0 shards (id, launch spec) as of this pass: ships what is due, in a
        task of its own (one at a time; never in the supervisor's way)."""
        if self._task is not None and not self._task.done():
            return
        now = time.monotonic()
        due = [
            (sid, spec)
            for sid, spec in shards
            if sid not in self._shipped and now - self._tried.get(sid, -1e9) >= self._retry_s
        ]
        if due:
            self._task = asyncio.get_running_loop().create_task(self._ship(due))

    def forget(self, live: Iterable[str]) -> None:
        keep = set(live)
        self._shipped = {s: d for s, d in self._shipped.items() if s in keep}
        self._tried = {s: t for s, t in self._tried.items() if s in keep}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _ship(self, due: list[tuple[str, Mapping[str, Any]]]) -> None:
        for sid, spec in due:
            directory = tokenizer_dir(spec)
            if directory is None:
                self._shipped[sid] = ""  # nothing to ship for this model: never asked again
                continue
            try:
                files = await asyncio.to_thread(read_tokenizer_files, directory)
            except (OSError, LlmgwError) as exc:
                self._shipped[sid] = ""
                log.warning("tokenizer_files_unreadable", shard=sid, dir=str(directory),
                            error=str(exc))  # fmt: skip
                continue
            upload = TokenizerUpload(
                shard_id=sid,
                files={n: base64.b64encode(d).decode() for n, d in files.files.items()},
            )
            try:
                await self._upload(upload)
            except Exception as exc:  # unreachable, refused: tried again later
                self._tried[sid] = time.monotonic()
                log.warning("tokenizer_files_upload_failed", shard=sid, error=str(exc)[:300])
                continue
            self._shipped[sid] = files.digest
            log.info("tokenizer_files_shipped", shard=sid, digest=files.digest,
                     dir=str(directory))  # fmt: skip
