"""The KV relay's persisted mirrors: one file per shard in ``<agent state dir>/kv/``.

A file holds the mirror's ``dump()`` and the engine process it describes (the supervisor's
``engine_generation``): a restarted agent reloads it only for the same engine process, and
forward-fills from that engine's replay socket; for any other process the file is stale. Files
are written atomically (temp file, fsync, rename) so a crash mid-write leaves the old one.
This module must NOT decide what to do with a bad file: ``load_mirror`` raises ``KVError``.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import msgpack

from llmgw.kv import BlockMirror, KVError
from llmgw.logs import get_logger

__all__ = ["load_mirror", "move_legacy_state", "save_mirror", "state_path"]

_log = get_logger(__name__)
_STATE_VERSION = 1


def state_path(directory: Path, shard_id: str) -> Path:
    # Quoted: shard ids may hold characters a file name must not ("/").
    return directory / (urllib.parse.quote(shard_id, safe="") + ".mirror")


def move_legacy_state(directory: Path) -> int:
    """Move mirrors an older agent kept in ``<directory>/kv/`` up into ``directory``; returns
    how many. Agents up to this change gave the relay ``<state>/kv`` and the relay added its
    own ``kv/``: without the move, the first agent restarted after an upgrade would find no
    mirror and leave every engine's view partial until the engine restarts. A quoted shard id
    never names a directory here (every file ends in ``.mirror``), so ``kv/`` is only legacy.
    A mirror already in ``directory`` is newer and wins."""
    legacy = directory / "kv"
    if not legacy.is_dir():
        return 0
    moved = 0
    for old in legacy.glob("*.mirror"):
        new = directory / old.name
        if new.exists():
            old.unlink(missing_ok=True)
            continue
        os.replace(old, new)
        moved += 1
    for leftover in legacy.glob("*.tmp"):  # a write cut short: the .mirror beside it is whole
        leftover.unlink(missing_ok=True)
    try:
        legacy.rmdir()
    except OSError as exc:
        _log.warning("kv_legacy_state_dir_kept", path=str(legacy), error=exc.strerror)
    if moved:
        _log.info("kv_legacy_state_moved", mirrors=moved, to=str(directory))
    return moved


def save_mirror(
    path: Path, *, shard_id: str, engine_generation: int, block_size: int | None, dumped: bytes
) -> None:
    state = {
        "v": _STATE_VERSION,
        "shard_id": shard_id,
        "engine_generation": engine_generation,
        "block_size": block_size,
        "mirror": dumped,
    }
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(msgpack.packb(state, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_mirror(
    path: Path, *, shard_id: str, engine_generation: int, max_blocks: int
) -> tuple[BlockMirror, int | None] | None:
    """(mirror, block size) saved for this engine process; None if none or another process's."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KVError(f"mirror state {path} is unreadable ({exc.strerror})") from None
    try:
        state = msgpack.unpackb(data, raw=False)
        version = state["v"]
        saved_shard = state["shard_id"]
        saved_generation = state["engine_generation"]
        block_size = state.get("block_size")
        dumped = state["mirror"]
    except Exception as exc:
        raise KVError(
            f"mirror state {path} is not a saved mirror ({type(exc).__name__}); it is ignored "
            "and the mirror refills from the engine"
        ) from None
    if version != _STATE_VERSION or saved_shard != shard_id:
        raise KVError(
            f"mirror state {path} is format {version!r} of shard {str(saved_shard)[:60]!r}, "
            f"expected format {_STATE_VERSION} of {shard_id!r}"
        )
    if block_size is not None and type(block_size) is not int:
        raise KVError(f"mirror state {path} has block_size {block_size!r}, not an int")
    if saved_generation != engine_generation:
        _log.info(
            "kv_mirror_state_stale",
            shard=shard_id,
            saved_generation=saved_generation,
            engine_generation=engine_generation,
        )
        return None
    return BlockMirror.load(dumped, max_blocks=max_blocks), block_size
