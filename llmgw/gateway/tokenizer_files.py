"""The gateway's copy of every model's tokenizer files, from Postgres, kept current.

``TokenizerFilesCache`` reads the models' sets (``store.tokenizers``: names and hashes) at
start, at once on a NOTIFY of ``TOKENIZERS_CHANNEL`` (an agent shipped new files), and every
``refresh_s`` as a safety net; it fetches only the bytes of files it does not hold yet, checks
each against its SHA-256, and publishes a new ``files`` mapping (a new object: the gateway's
``LocalTokenizers.sync`` notices by identity). While Postgres is down it keeps what it has:
the gateway goes on tokenizing with the files it loaded (fail static, as the route table).

Bounded: every file is capped by the agent API before it is stored; the cache holds at most
one set per served model, and drops files no set names.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.errors import LlmgwError
from llmgw.gateway.notified import NotifiedCache
from llmgw.kv.hf_tokenizer import TokenizerFiles
from llmgw.logs import get_logger
from llmgw.store.notify import NotifyHub
from llmgw.store.tokenizers import (
    TOKENIZERS_CHANNEL,
    read_file_contents,
    read_model_tokenizers,
)

__all__ = ["TokenizerFilesCache"]

log = get_logger("llmgw.gateway")


class TokenizerFilesCache(NotifiedCache):
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        notify: NotifyHub | None,
        refresh_s: float = 30.0,
    ) -> None:
        super().__init__(
            "tokenizer_files",
            notify=notify,
            channels=[TOKENIZERS_CHANNEL],
            refresh_s=refresh_s,
        )
        self._sessions = sessions
        self.files: Mapping[str, TokenizerFiles] = {}
        self._blobs: dict[str, bytes] = {}  # sha256 -> bytes, of the sets held
        self.changed = asyncio.Event()  # set after every refresh that changed a set (tests)

    async def refresh(self) -> None:
        async with self._sessions() as session, session.begin():
            rows = await read_model_tokenizers(session)
            current = self.files
            wanted = {
                sha
                for r in rows
                if current.get(r.model) is None or current[r.model].digest != r.digest
                for sha in r.files.values()
                if sha not in self._blobs
            }
            fetched = await read_file_contents(session, wanted)
        blobs = dict(self._blobs)
        for sha, data in fetched.items():
            if hashlib.sha256(data).hexdigest() == sha:
                blobs[sha] = data
        out: dict[str, TokenizerFiles] = {}
        for r in rows:
            held = current.get(r.model)
            if held is not None and held.digest == r.digest:
                out[r.model] = held
                continue
            if not all(sha in blobs for sha in r.files.values()):
                log.warning("gateway_tokenizer_files_incomplete", model=r.model, digest=r.digest)
                if held is not None:
                    out[r.model] = held
                continue
            try:
                out[r.model] = TokenizerFiles({n: blobs[sha] for n, sha in r.files.items()})
            except LlmgwError as exc:
                log.warning("gateway_tokenizer_files_refused", model=r.model, error=exc.message)
                if held is not None:
                    out[r.model] = held
        used = {sha for files in out.values() for sha in files.file_digests().values()}
        self._blobs = {sha: data for sha, data in blobs.items() if sha in used}
        changed = {m: f.digest for m, f in out.items()} != {m: f.digest for m, f in current.items()}
        if changed:
            self.files = out
            self.changed.set()

    def holds(self) -> int:
        return len(self.files)
