"""A model's tokenizer files, as a node's agent hands them over (``TOKENIZER_PATH``).

The upload names a shard; the files are filed under the served model name of that shard's
launch spec, and only for a live shard of the uploading node (a node cannot set another's
model's tokenizer). The files are checked as the gateways will load them (names, sizes, a
tokenizer.json present: ``TokenizerFiles``), then, for a set the model does not have yet,
loaded and tried in a worker process (``llmgw.tokenizing``: off this event loop, within a
deadline and a memory cap): the tokenizer must load and encode, and its chat template render
sample chats within the template budget (``kv.template_budget``) the gateways render with. A
set that fails is refused (422) with the reason, and never stored: a template that loops for
seconds, or builds gigabytes, would otherwise reach every gateway and outlive a restart in
Postgres. Then the files are stored content-addressed (``store.tokenizers``): a set already
held is a no-op, a new one NOTIFYs the gateways.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import uuid
from typing import Final

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.errors import ConflictError, LlmgwError, SpecError, TooManyRequestsError, clip
from llmgw.kv.hf_tokenizer import TokenizerFiles
from llmgw.logs import get_logger
from llmgw.protocol.tokenizers import TokenizerUpload, TokenizerUploadResponse
from llmgw.store.tokenizers import read_model_digest, shard_model, store_model_tokenizer
from llmgw.tokenizing.pool import WorkerPool

__all__ = ["check_tokenizer_files", "store_tokenizer"]

log = get_logger("llmgw.controlplane.agentapi")

# Loading a 260k-vocabulary tokenizer.json takes seconds; a check past this is a refusal.
CHECK_DEADLINE_S: Final = 60.0
# The gateways' default cap on a rendered prompt (gateway.local_tokenize_max_chars).
CHECK_MAX_CHARS: Final = 1_000_000
# Checks at once in this process (each a process of its own, ~the files' size x 16 of memory);
# an upload past them is asked to come back (the agent retries).
_MAX_CHECKS: Final = 2
_checking = 0


def _decode(upload: TokenizerUpload) -> TokenizerFiles:
    files: dict[str, bytes] = {}
    for name, encoded in upload.files.items():
        try:
            files[name] = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise SpecError(f"files.{clip(name)} is not base64") from None
    try:
        return TokenizerFiles(files)
    except LlmgwError as exc:
        raise SpecError(exc.message) from None


async def check_tokenizer_files(
    files: TokenizerFiles, *, deadline_s: float = CHECK_DEADLINE_S
) -> str | None:
    """Why the files are not a tokenizer the gateways can use (None: they are): loaded and
    tried in a worker process of its own, killed past ``deadline_s``."""
    global _checking
    if _checking >= _MAX_CHECKS:
        raise TooManyRequestsError(
            f"{_MAX_CHECKS} tokenizer uploads are being checked already; retry shortly",
            retry_after_s=5.0,
        )
    _checking += 1
    # A pool of one, for this check alone: uploads are rare (once per shard start), and a
    # process per check leaves nothing between them.
    pool = WorkerPool(workers=1, deadline_s=deadline_s, max_waiting=1, name="tokenizer_check")
    try:
        got = await pool.call(
            {"op": "check", "files": dict(files.files), "max_chars": CHECK_MAX_CHARS},
            digest=None,
            wait_s=deadline_s + 30.0,  # the worker's start, then the deadline
        )
    finally:
        _checking -= 1
        await pool.aclose()
    if isinstance(got, str):
        if got == "deadline":
            return f"loading and trying the files took over {deadline_s:g} s"
        return f"the files could not be tried ({got})"
    if got.get("ok"):
        return None
    return str(got.get("error", "the files failed"))


async def store_tokenizer(
    sessions: async_sessionmaker[AsyncSession], node_id: uuid.UUID, upload: TokenizerUpload
) -> TokenizerUploadResponse:
    # Off the loop: hashing 48 MB takes ~100 ms (hashlib lets the GIL go while it hashes); the
    # hashes are kept (``TokenizerFiles``), the store reuses them.
    files = await asyncio.to_thread(_decode, upload)
    digest = files.digest
    async with sessions() as session, session.begin():
        model = await _model_of(session, node_id, upload.shard_id)
        held = await read_model_digest(session, model)
    if held != digest:
        # Tried outside any transaction: it may take seconds.
        refused = await check_tokenizer_files(files)
        if refused is not None:
            log.warning("tokenizer_files_refused", model=model, digest=digest,
                        node=str(node_id), reason=clip(refused))  # fmt: skip
            raise SpecError(
                f"the tokenizer files of {clip(model)!r} were refused: {clip(refused)}; ship "
                "the model's own files, or set the profile's tokenizer to none",
                field="files",
            )
    async with sessions() as session, session.begin():
        model = await _model_of(session, node_id, upload.shard_id)
        changed = await store_model_tokenizer(
            session,
            model=model,
            digest=digest,
            files=files.files,
            source=f"node {node_id} shard {upload.shard_id}",
            shas=files.file_digests(),
        )
    if changed:
        log.info("tokenizer_files_stored", model=model, digest=digest, node=str(node_id),
                 shard=upload.shard_id)  # fmt: skip
    return TokenizerUploadResponse(model=model, digest=digest, changed=changed)


async def _model_of(session: AsyncSession, node_id: uuid.UUID, shard_id: str) -> str:
    model = await shard_model(session, node_id=node_id, shard_id=shard_id)
    if model is None:
        raise ConflictError(
            f"shard {clip(shard_id)!r} is not a live shard of this node; upload "
            "the files of a shard the node runs",
        )
    return model
