"""A model's tokenizer files, as a node's agent hands them over (``TOKENIZER_PATH``).

The upload names a shard; the files are filed under the served model name of that shard's
launch spec, and only for a live shard of the uploading node (a node cannot set another's
model's tokenizer). The files are checked as the gateways will load them (names, sizes, a
tokenizer.json present: ``TokenizerFiles``) before anything is written, then stored
content-addressed (``store.tokenizers``): a set already held is a no-op, a new one NOTIFYs the
gateways.
"""

from __future__ import annotations

import base64
import binascii
import uuid

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.errors import ConflictError, LlmgwError, SpecError, clip
from llmgw.kv.hf_tokenizer import TokenizerFiles
from llmgw.logs import get_logger
from llmgw.protocol.tokenizers import TokenizerUpload, TokenizerUploadResponse
from llmgw.store.tokenizers import shard_model, store_model_tokenizer

__all__ = ["store_tokenizer"]

log = get_logger("llmgw.controlplane.agentapi")


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


async def store_tokenizer(
    sessions: async_sessionmaker[AsyncSession], node_id: uuid.UUID, upload: TokenizerUpload
) -> TokenizerUploadResponse:
    files = _decode(upload)
    digest = files.digest
    async with sessions() as session, session.begin():
        model = await shard_model(session, node_id=node_id, shard_id=upload.shard_id)
        if model is None:
            raise ConflictError(
                f"shard {clip(upload.shard_id)!r} is not a live shard of this node; upload "
                "the files of a shard the node runs",
            )
        changed = await store_model_tokenizer(
            session,
            model=model,
            digest=digest,
            files=files.files,
            source=f"node {node_id} shard {upload.shard_id}",
        )
    if changed:
        log.info("tokenizer_files_stored", model=model, digest=digest, node=str(node_id),
                 shard=upload.shard_id)  # fmt: skip
    return TokenizerUploadResponse(model=model, digest=digest, changed=changed)
