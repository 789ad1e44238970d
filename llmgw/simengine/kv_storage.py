"""The shared-storage directory behind `--kv-transfer-config`: one file per stored KV block.

The thin I/O shell over kv_transfer.py (which says what is stored and why): a producer
writes a block's file atomically (a temporary name in the same directory, then a rename), so
a consumer on another process never sees half a file; a consumer only asks whether a block's
file exists, as vLLM's ExampleConnector only asks whether a prompt's folder does.

Must NOT decide which blocks move (the scheduler and kv_transfer.py do).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from llmgw.errors import ConfigError
from llmgw.kv.hashing import BlockHash
from llmgw.simengine.kv_transfer import (
    KvSave,
    KvTransfer,
    block_file_body,
    block_file_name,
    leading_run,
)

__all__ = ["SharedKvStorage", "check_storage_dir"]


def check_storage_dir(transfer: KvTransfer) -> Path:
    """The storage directory, refused at startup unless this role can use it: an engine that
    cannot write would prefill for nothing, one that cannot read would never load a block."""
    path = Path(transfer.storage_path)
    field = "kv_transfer_config.kv_connector_extra_config.shared_storage_path"
    if not path.is_dir():
        raise ConfigError(
            f"--kv-transfer-config shared_storage_path {str(path)!r} is not a directory; "
            "create it (the producer and the consumer must both see it) or fix the path",
            field=field,
        )
    needs = os.R_OK | os.X_OK | (os.W_OK if transfer.is_producer else 0)
    if not os.access(path, needs):
        what = "read and write" if transfer.is_producer else "read"
        raise ConfigError(
            f"--kv-transfer-config shared_storage_path {str(path)!r} is not readable"
            f"{' and writable' if transfer.is_producer else ''} by this process; a "
            f"{transfer.role} must {what} it: fix its permissions or choose another directory",
            field=field,
        )
    return path


class SharedKvStorage:
    def __init__(self, transfer: KvTransfer) -> None:
        self.transfer = transfer
        self.path = check_storage_dir(transfer)

    def _file(self, block_hash: BlockHash) -> Path:
        return self.path / block_file_name(block_hash)

    def leading_run(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, have a stored file (the scheduler's lookup)."""
        return leading_run(hashes, lambda h: self._file(h).exists())

    def save(self, saves: Sequence[KvSave]) -> int:
        """Write every block not stored yet; the number of files written. Runs on a worker
        thread while the step's modelled time passes."""
        written = 0
        for save in saves:
            for parent, block_hash, tokens in save.blocks():
                target = self._file(block_hash)
                if target.exists():
                    continue  # the same hash is the same KV: another prompt stored it
                self._write_atomically(target, block_file_body(parent, tokens))
                written += 1
        return written

    def _write_atomically(self, target: Path, body: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(body)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
