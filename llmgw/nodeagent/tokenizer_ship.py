"""Shipping each ready shard's model tokenizer files to the control plane, once.

The control plane usually does not hold the model; the gateways tokenize prompts locally with
the model's own tokenizer files, so the agent reads them from a directory on its node when a
rank-0 shard first becomes ready and POSTs them (``protocol.tokenizers``). Which directory:

- the profile's ``tokenizer`` when it is a path (an HF tokenizer directory beside a GGUF
  model, say); one that holds no ``tokenizer.json`` is logged as a warning naming the path and
  the field, and nothing is shipped;
- nothing at all when it is ``none`` (the gateways then ask a replica's ``/tokenize``);
- else the engine's own answer (``Engine.tokenizer_dir``: its ``--tokenizer`` argument, else
  ``model_path``; the simulator's packaged tiny model; nothing for llama.cpp's GGUF files),
  when that is a directory on this node holding a ``tokenizer.json``. A model with none (a
  hub name not on disk) ships nothing, and the gateways fall back to a replica's
  ``/tokenize``.

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
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmgw.engines import TOKENIZER_NONE, Engine, Profile, reference_engine
from llmgw.errors import LlmgwError
from llmgw.kv.hf_tokenizer import MAX_FILE_BYTES, TOKENIZER_FILE_NAMES, TokenizerFiles
from llmgw.logs import get_logger
from llmgw.nodeagent.policy import under_root
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.protocol.tokenizers import TokenizerUpload

__all__ = ["TokenizerShipper", "read_tokenizer_files", "tokenizer_dir"]

log = get_logger("llmgw.nodeagent")

Upload = Callable[[TokenizerUpload], Any]
# The node's engine adapters by name (EngineRegistry.get): a SpecError for one it lacks.
Engines = Callable[[str], Engine]


def _holds_tokenizer(directory: Path) -> bool:
    return directory.is_dir() and (directory / "tokenizer.json").is_file()


def _profile(spec: Mapping[str, Any]) -> Profile | None:
    raw = spec.get("profile")
    if not isinstance(raw, Mapping):
        return None
    try:
        return Profile.model_validate({"name": "unnamed", **raw})
    except ValidationError:
        return None


def tokenizer_dir(
    spec: Mapping[str, Any],
    engines: Engines = reference_engine,
    *,
    allowed_roots: tuple[str, ...] = (),
) -> Path | None:
    """The directory whose tokenizer files to ship for a shard, from its launch spec; None:
    nothing to ship. ``engines``: the node's adapters by engine name (``EngineRegistry.get``);
    ``allowed_roots``: the node's ``agent.policy.allowed_model_roots``, which a profile's
    tokenizer directory must sit under as a model does (none: anywhere).
    """
    profile = _profile(spec)
    if profile is None or profile.tokenizer == TOKENIZER_NONE:
        return None
    if profile.tokenizer:
        if allowed_roots and not under_root(profile.tokenizer, allowed_roots):
            log.warning(
                "profile_tokenizer_refused",
                shard=str(spec.get("shard_id", "")),
                profile=profile.name,
                field="tokenizer",
                path=profile.tokenizer,
                problem="the profile's tokenizer directory is not under an allowed root "
                f"({', '.join(allowed_roots)}; agent.policy.allowed_model_roots); nothing is "
                "shipped and the gateways ask a replica's /tokenize",
            )
            return None
        directory = Path(profile.tokenizer)
        if _holds_tokenizer(directory):
            return directory
        log.warning(
            "profile_tokenizer_not_found",
            shard=str(spec.get("shard_id", "")),
            profile=profile.name,
            field="tokenizer",
            path=profile.tokenizer,
            problem="the profile's tokenizer field names no directory holding tokenizer.json "
            "on this node; nothing is shipped and the gateways ask a replica's /tokenize. "
            "Point the field at the tokenizer's directory on every node, or set it to 'none'",
        )
        return None
    try:
        engine = engines(profile.engine)
    except LlmgwError:
        return None
    claimed = engine.tokenizer_dir(profile)
    if claimed is None:
        return None
    directory = Path(claimed)
    return directory if _holds_tokenizer(directory) else None


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
    def __init__(
        self,
        upload: Upload,
        *,
        retry_s: float = 30.0,
        engines: Engines = reference_engine,
        allowed_roots: tuple[str, ...] = (),
    ) -> None:
        self._upload = upload
        self._retry_s = retry_s
        self._engines = engines
        self._allowed_roots = allowed_roots
        self._shipped: dict[str, str] = {}  # shard -> digest shipped
        self._tried: dict[str, float] = {}  # shard -> when an upload last failed
        self._task: asyncio.Task[None] | None = None

    def follow(self, runtimes: Mapping[str, ShardRuntime]) -> None:
        """The supervisor's shards after a pass: what is gone is forgotten, and each ready
        leader's tokenizer files are shipped (once per shard)."""
        self.forget(runtimes)
        self.ready(
            (sid, rt.record.spec)
            for sid, rt in runtimes.items()
            if rt.phase == "live" and rt.health == "ready" and rt.record.spec_view.leader
        )

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
            directory = tokenizer_dir(spec, self._engines, allowed_roots=self._allowed_roots)
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
