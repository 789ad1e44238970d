"""The KV-delta stream: what an agent POSTs to each control plane instance (docs/architecture.md §5).

One request carries one shard's change: ``reset`` (drop what you hold, then take ``added`` as the
whole view) or a delta from ``base_version`` to ``new_version``. Hashes travel as packed
big-endian uint64 (8 bytes each, per medium) inside a msgpack map, not as lists: a JSON or
msgpack list of 100k ints costs 10x the bytes and a Python object per hash to parse.

A change larger than ``MAX_BLOCKS_PER_MESSAGE`` goes out as several requests at the same
``new_version``: the first carries the base (or ``reset``), the rest have
``base_version == new_version``, and only the last has ``complete=True``. A receiver treats the
view as partial until the complete one arrives, so an interrupted sequence never passes for a
whole view (the agent's next request then gets ``need_full``).

Bounds (refused with ``KvStreamError``, never trimmed): ``MAX_BODY_BYTES`` per body,
``MAX_BLOCKS_PER_MESSAGE`` hashes in ``added`` and ``removed`` together, ``MAX_MEDIA`` tiers,
``MAX_SHARD_ID_CHARS``. This module must NOT do I/O or import either side of the protocol.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

import msgpack

from llmgw.errors import SpecError
from llmgw.protocol.sync import KV_PATH  # one definition of the route, with the others

__all__ = [
    "KV_CONTENT_TYPE",
    "KV_PATH",
    "KV_STREAM_VERSION",
    "MAX_BLOCKS_PER_MESSAGE",
    "MAX_BODY_BYTES",
    "MAX_MEDIA",
    "MAX_MEDIUM_CHARS",
    "MAX_SHARD_ID_CHARS",
    "KvDeltaRequest",
    "KvResult",
    "KvStreamError",
    "chunk_change",
    "decode_kv_request",
    "decode_kv_response",
    "encode_kv_request",
    "encode_kv_response",
    "pack_hashes",
    "unpack_hashes",
]

KV_CONTENT_TYPE: Final = "application/x-msgpack"
# Bumped on any incompatible change of the body; a receiver refuses other versions (400), so a
# mixed-version fleet fails loudly instead of mis-reading hashes.
KV_STREAM_VERSION: Final = 1
# 16384 hashes = 128 KiB packed: one request is decoded and applied in ~2-10 ms of the
# receiver's loop (measured ~1-6 ms per 10k hashes into a growing index), where 131072 held it
# 60-85 ms a request (hardening-3 finding 7); a full copy of a large vLLM cache (~500k blocks)
# is ~30 requests.
MAX_BLOCKS_PER_MESSAGE: Final = 16_384
MAX_MEDIA: Final = 8  # GPU, CPU, STORAGE today; room for connectors' own names
MAX_MEDIUM_CHARS: Final = 32
MAX_SHARD_ID_CHARS: Final = 200
# Hashes plus per-medium keys and the scalar fields; a body past this is refused unread.
MAX_BODY_BYTES: Final = MAX_BLOCKS_PER_MESSAGE * 8 + 16 * 1024

KvResult = Literal["ack", "retry", "need_full"]
_RESULTS: frozenset[str] = frozenset(get_args(KvResult))
_MAX_VERSION = (1 << 63) - 1


class KvStreamError(SpecError):
    """A KV-delta body or response that breaks the wire rules (answered 400 by receivers)."""

    code = "kv-stream-invalid"


def pack_hashes(hashes: Iterator[int] | tuple[int, ...] | list[int] | array[int]) -> bytes:
    """uint64 hashes as big-endian 8-byte words, concatenated."""
    try:
        packed = array("Q", hashes)
    except OverflowError:
        raise KvStreamError(
            "a block hash does not fit an unsigned 64-bit integer; send hash64() of the digest",
            field="added",
        ) from None
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_hashes(data: bytes, *, what: str = "hashes") -> array[int]:
    """The inverse of ``pack_hashes``; refuses a length that is not a multiple of 8."""
    if len(data) % 8:
        raise KvStreamError(
            f"{what} is {len(data)} bytes, not a whole number of 8-byte hashes", field=what
        )
    out = array("Q")
    out.frombytes(data)
    if sys.byteorder == "little":
        out.byteswap()
    return out


@dataclass(frozen=True, slots=True)
class KvDeltaRequest:
    """One shard's change, from the agent's mirror to one control plane instance.

    ``added``/``removed`` map a medium ("GPU", "CPU", ...) to uint64 hashes; with ``reset``,
    ``added`` is the whole view and ``removed`` is empty. ``partial`` is the mirror's flag (the
    view may lack blocks after an unfillable gap); ``block_size`` is the engine's, from its
    events (None before the first store), so a receiver can refuse a view hashed differently
    from the profile it routes with.
    """

    shard_id: str
    base_version: int
    new_version: int
    reset: bool = False
    complete: bool = True
    partial: bool = False
    block_size: int | None = None
    added: Mapping[str, array[int]] = field(default_factory=dict)
    removed: Mapping[str, array[int]] = field(default_factory=dict)
    v: int = KV_STREAM_VERSION

    @property
    def num_blocks(self) -> int:
        return sum(len(h) for h in self.added.values()) + sum(len(h) for h in self.removed.values())


def encode_kv_request(request: KvDeltaRequest) -> bytes:
    """The msgpack body; raises ``KvStreamError`` for a request the receiver would refuse."""
    _check(request)
    body = {
        "v": request.v,
        "shard_id": request.shard_id,
        "base_version": request.base_version,
        "new_version": request.new_version,
        "reset": request.reset,
        "complete": request.complete,
        "partial": request.partial,
        "block_size": request.block_size,
        "added": {m: pack_hashes(h) for m, h in request.added.items()},
        "removed": {m: pack_hashes(h) for m, h in request.removed.items()},
    }
    data: bytes = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_BODY_BYTES:
        raise KvStreamError(
            f"KV delta for shard {request.shard_id!r} is {len(data)} bytes, over the "
            f"{MAX_BODY_BYTES}-byte cap; split it with chunk_change()",
            field="added",
        )
    return data


def _check(r: KvDeltaRequest) -> None:
    if r.v != KV_STREAM_VERSION:
        raise KvStreamError(
            f"KV stream version {r.v!r} is not supported; this side speaks "
            f"{KV_STREAM_VERSION} (upgrade the older of agent and control plane)",
            field="v",
        )
    if not isinstance(r.shard_id, str) or not 0 < len(r.shard_id) <= MAX_SHARD_ID_CHARS:
        raise KvStreamError(
            f"shard_id {str(r.shard_id)[:40]!r} must be 1..{MAX_SHARD_ID_CHARS} characters",
            field="shard_id",
        )
    for name in ("base_version", "new_version"):
        value = getattr(r, name)
        if type(value) is not int or not 0 <= value <= _MAX_VERSION:
            raise KvStreamError(f"{name} {value!r} must be an int in 0..2**63-1", field=name)
    if not r.reset and r.new_version < r.base_version:
        raise KvStreamError(
            f"new_version {r.new_version} is below base_version {r.base_version}; versions "
            "only move forward (send reset=True to start over)",
            field="new_version",
        )
    for name in ("reset", "complete", "partial"):
        if type(getattr(r, name)) is not bool:
            raise KvStreamError(f"{name} must be a boolean", field=name)
    if r.block_size is not None and (type(r.block_size) is not int or r.block_size < 0):
        raise KvStreamError(
            f"block_size {r.block_size!r} must be a non-negative int or nil", field="block_size"
        )
    if r.reset and any(len(h) for h in r.removed.values()):
        raise KvStreamError(
            "a reset carries the whole view in 'added'; 'removed' must be empty", field="removed"
        )
    for name in ("added", "removed"):
        media = getattr(r, name)
        if len(media) > MAX_MEDIA:
            raise KvStreamError(f"{name} has {len(media)} media, more than {MAX_MEDIA}", field=name)
        for medium in media:
            if not isinstance(medium, str) or not 0 < len(medium) <= MAX_MEDIUM_CHARS:
                raise KvStreamError(
                    f"{name} medium {str(medium)[:40]!r} must be 1..{MAX_MEDIUM_CHARS} characters",
                    field=name,
                )
    if r.num_blocks > MAX_BLOCKS_PER_MESSAGE:
        raise KvStreamError(
            f"KV delta for shard {r.shard_id!r} carries {r.num_blocks} hashes, over "
            f"{MAX_BLOCKS_PER_MESSAGE}; split it with chunk_change()",
            field="added",
        )


def _media(value: object, name: str) -> dict[str, array[int]]:
    if type(value) is not dict:
        raise KvStreamError(f"{name} must be a map of medium to packed hashes", field=name)
    if len(value) > MAX_MEDIA:
        raise KvStreamError(f"{name} has {len(value)} media, more than {MAX_MEDIA}", field=name)
    out: dict[str, array[int]] = {}
    for medium, packed in value.items():
        if type(medium) is not str or type(packed) is not bytes:
            raise KvStreamError(
                f"{name} must map medium names to packed bytes, got "
                f"{type(medium).__name__} -> {type(packed).__name__}",
                field=name,
            )
        out[medium] = unpack_hashes(packed, what=name)
    return out


_FIELDS = frozenset(
    {
        "v",
        "shard_id",
        "base_version",
        "new_version",
        "reset",
        "complete",
        "partial",
        "block_size",
        "added",
        "removed",
    }
)


def decode_kv_request(data: bytes) -> KvDeltaRequest:
    """Parse and check a body; raises ``KvStreamError`` and nothing else for any input."""
    if len(data) > MAX_BODY_BYTES:
        raise KvStreamError(
            f"KV delta body is {len(data)} bytes, over the {MAX_BODY_BYTES}-byte cap",
            field="body",
        )
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_BODY_BYTES,
            max_str_len=4096,
            max_array_len=0,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:
        # msgpack raises a version-dependent mix (ExtraData, FormatError, ValueError for the
        # limits, UnicodeDecodeError, ...): one type for the receiver.
        raise KvStreamError(
            f"KV delta body is not a valid msgpack map ({type(exc).__name__})", field="body"
        ) from None
    if type(raw) is not dict:
        raise KvStreamError("KV delta body must be a msgpack map", field="body")
    missing = {"v", "shard_id", "base_version", "new_version"} - raw.keys()
    if missing:
        raise KvStreamError(f"KV delta body lacks {sorted(missing)}", field="body")
    if raw["v"] != KV_STREAM_VERSION:
        raise KvStreamError(
            f"KV stream version {raw['v']!r} is not supported; this side speaks "
            f"{KV_STREAM_VERSION} (upgrade the older of agent and control plane)",
            field="v",
        )
    # Unknown keys are ignored, not refused: a newer agent may add an optional field within the
    # same version without breaking older instances.
    request = KvDeltaRequest(
        shard_id=raw["shard_id"],
        base_version=raw["base_version"],
        new_version=raw["new_version"],
        reset=raw.get("reset", False),
        complete=raw.get("complete", True),
        partial=raw.get("partial", False),
        block_size=raw.get("block_size"),
        added=_media(raw.get("added", {}), "added"),
        removed=_media(raw.get("removed", {}), "removed"),
    )
    _check(request)
    return request


def encode_kv_response(result: KvResult) -> bytes:
    return json.dumps({"result": result}).encode()


def decode_kv_response(data: bytes) -> KvResult:
    """The receiver's verdict; raises ``KvStreamError`` for anything but the three results."""
    try:
        value = json.loads(data[:4096])
        result = value["result"]
    except Exception:
        raise KvStreamError(
            f"KV delta response {data[:60]!r} is not {{'result': ack|retry|need_full}}",
            field="result",
        ) from None
    if result not in _RESULTS:
        raise KvStreamError(
            f"KV delta result {str(result)[:40]!r} is not one of {sorted(_RESULTS)}",
            field="result",
        )
    return result  # type: ignore[no-any-return]


def chunk_change(
    *,
    shard_id: str,
    base_version: int,
    new_version: int,
    reset: bool,
    partial: bool,
    block_size: int | None,
    added: Mapping[str, tuple[int, ...] | array[int]],
    removed: Mapping[str, tuple[int, ...] | array[int]],
    max_blocks: int = MAX_BLOCKS_PER_MESSAGE,
) -> list[KvDeltaRequest]:
    """One change as requests of at most ``max_blocks`` hashes each (see the module docstring).

    Removals go first: a receiver applies each request's removals before its additions, and a
    delta never holds one hash in both lists of one medium, so any split order is exact.
    """
    if max_blocks < 1:
        raise KvStreamError("max_blocks must be positive", field="max_blocks")
    items: list[tuple[bool, str, tuple[int, ...] | array[int]]] = [
        *((False, m, h) for m, h in removed.items() if len(h)),
        *((True, m, h) for m, h in added.items() if len(h)),
    ]
    out: list[KvDeltaRequest] = []
    cur_added: dict[str, array[int]] = {}
    cur_removed: dict[str, array[int]] = {}
    room = max_blocks

    def flush() -> None:
        nonlocal cur_added, cur_removed, room
        first = not out
        out.append(
            KvDeltaRequest(
                shard_id=shard_id,
                base_version=base_version if first else new_version,
                new_version=new_version,
                reset=reset and first,
                complete=False,
                partial=partial,
                block_size=block_size,
                added=cur_added,
                removed=cur_removed,
            )
        )
        cur_added, cur_removed, room = {}, {}, max_blocks

    for is_add, medium, hashes in items:
        start = 0
        while start < len(hashes):
            if room == 0:
                flush()
            take = min(room, len(hashes) - start)
            target = cur_added if is_add else cur_removed
            piece = array("Q", hashes[start : start + take])
            if medium in target:
                target[medium].extend(piece)
            else:
                target[medium] = piece
            start += take
            room -= take
    flush()
    last = out[-1]
    out[-1] = KvDeltaRequest(
        shard_id=last.shard_id,
        base_version=last.base_version,
        new_version=last.new_version,
        reset=last.reset,
        complete=True,
        partial=last.partial,
        block_size=last.block_size,
        added=last.added,
        removed=last.removed,
    )
    return out
