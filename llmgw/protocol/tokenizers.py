"""The tokenizer upload: an agent hands the control plane a model's tokenizer files.

When a shard first becomes ready its agent reads the tokenizer files of the model's
directory on its node (the named files only, each capped; ``llmgw.kv.hf_tokenizer``) and
POSTs them here, once per shard and set of files: ``files`` maps each file's name to its
bytes in base64. The control plane stores them content-addressed and every gateway loads
them for the shard's served model. Bounded by ``TOKENIZER_MAX_BODY_BYTES`` (the control
plane's setting caps the body before it is read). This module must NOT do I/O.
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from llmgw.protocol.sync import PROTOCOL_VERSION

__all__ = [
    "TOKENIZER_MAX_BODY_BYTES",
    "TOKENIZER_PATH",
    "TokenizerUpload",
    "TokenizerUploadResponse",
]

TOKENIZER_PATH: Final = "/agent/v1/tokenizer"
# 64 MiB of files in base64 (4/3) and the JSON around them.
TOKENIZER_MAX_BODY_BYTES: Final = 88 * 1024 * 1024


class TokenizerUpload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol_version: int = PROTOCOL_VERSION
    shard_id: str = Field(min_length=1, max_length=64)
    # file name -> base64 of its bytes; the names are checked by the control plane.
    files: dict[str, str] = Field(max_length=8)


class TokenizerUploadResponse(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    digest: str
    changed: bool
