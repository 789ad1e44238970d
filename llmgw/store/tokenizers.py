"""The SQL of models' tokenizer files: what an agent ships, what every gateway loads.

Files are content-addressed (``tokenizer_files``, keyed by SHA-256: inserted once, never
updated); a served model's set is one row of ``model_tokenizers`` (name -> SHA-256, and the
set's digest). A write that changes a model's set NOTIFYs ``TOKENIZERS_CHANNEL`` in the same
transaction, so the gateways hear of it only once it committed. Functions take a session and
never commit: the caller owns the transaction.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.store.tables import ModelTokenizer, TokenizerFile

__all__ = [
    "TOKENIZERS_CHANNEL",
    "TokenizerRow",
    "read_file_contents",
    "read_model_digest",
    "read_model_tokenizers",
    "shard_model",
    "store_model_tokenizer",
]

# NOTIFYed (payload: the model's name) whenever a model's tokenizer set changes.
TOKENIZERS_CHANNEL = "llmgw_tokenizers_changed"


@dataclass(frozen=True, slots=True)
class TokenizerRow:
    model: str
    digest: str
    files: Mapping[str, str]  # file name -> SHA-256


_SHARD_MODEL = text(
    "SELECT coalesce(nullif(s.launch_spec #>> '{profile,served_model_name}', ''), "
    "s.launch_spec #>> '{profile,model}', '') AS model "
    "FROM shards s WHERE s.id = :shard AND s.node_id = :node AND NOT s.released"
)


async def shard_model(session: AsyncSession, *, node_id: uuid.UUID, shard_id: str) -> str | None:
    """The served model name of a live shard of this node; None for a shard it does not run."""
    try:
        shard = uuid.UUID(shard_id)
    except ValueError:
        return None
    got = await session.execute(_SHARD_MODEL, {"shard": shard, "node": node_id})
    row = got.first()
    return str(row.model) if row is not None and row.model else None


async def store_model_tokenizer(
    session: AsyncSession,
    *,
    model: str,
    digest: str,
    files: Mapping[str, bytes],
    source: str,
    shas: Mapping[str, str] | None = None,
) -> bool:
    """Store the files (those not held yet) and make them ``model``'s set; True when the set
    changed (and the gateways were told). ``shas``: each file's SHA-256 where the caller has
    them (hashing 64 MB here would hold the event loop)."""
    current = await session.get(ModelTokenizer, model, with_for_update=True)
    if current is not None and current.digest == digest:
        return False
    names: dict[str, str] = {}
    for name, data in sorted(files.items()):
        sha = shas[name] if shas is not None else hashlib.sha256(data).hexdigest()
        names[name] = sha
        await session.execute(
            insert(TokenizerFile)
            .values(sha256=sha, content=data, size=len(data))
            .on_conflict_do_nothing(index_elements=["sha256"])
        )
    await session.execute(
        insert(ModelTokenizer)
        .values(model=model, digest=digest, files=names, source=source)
        .on_conflict_do_update(
            index_elements=["model"],
            set_={"digest": digest, "files": names, "source": source, "updated_at": text("now()")},
        )
    )
    await session.execute(
        text("SELECT pg_notify(:channel, :payload)"),
        {"channel": TOKENIZERS_CHANNEL, "payload": model[:200]},
    )
    return True


async def read_model_digest(session: AsyncSession, model: str) -> str | None:
    """The digest of the set ``model`` has now (None: none stored)."""
    current = await session.get(ModelTokenizer, model)
    return None if current is None else str(current.digest)


async def read_model_tokenizers(session: AsyncSession) -> list[TokenizerRow]:
    """Every model's set (names and hashes only: a gateway fetches the bytes it lacks)."""
    result = await session.execute(
        text("SELECT model, digest, files FROM model_tokenizers ORDER BY model")
    )
    return [
        TokenizerRow(str(r.model), str(r.digest), {str(k): str(v) for k, v in r.files.items()})
        for r in result
        if isinstance(r.files, dict)
    ]


async def read_file_contents(session: AsyncSession, shas: Iterable[str]) -> dict[str, bytes]:
    wanted = sorted(set(shas))
    if not wanted:
        return {}
    result = await session.execute(
        text("SELECT sha256, content FROM tokenizer_files WHERE sha256 = ANY(:shas)"),
        {"shas": wanted},
    )
    return {str(r.sha256): bytes(r.content) for r in result}
