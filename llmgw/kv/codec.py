"""vLLM's KV-event payloads: the msgpack ``KVEventBatch`` a ZMQ message carries.

Holds ``encode_batch``/``decode_batch`` for payloads in both event shapes (positional tagged
arrays, vLLM <= 0.23; tagged maps, >= 0.24) and both hash forms (uint64 or 32-byte digest). The
byte layout is what vLLM's publisher (``vllm/distributed/kv_events.py``) sends, reproduced to the byte (msgspec's
choices included: float64 timestamps, map16 headers on structs with more than 15 fields). The
frames around payloads live in ``llmgw.kv.frames``.

The decoder faces the network: for any input it returns or raises ``KVDecodeError``, never
another exception, and skips (and counts) event tags it does not know so a newer vLLM cannot
stall the listener. This module must NOT open sockets or import zmq/asyncio: the listener
belongs to the node agent and the publisher to the simulator; they pass frames in and out.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from llmgw.kv.errors import KVDecodeError, KVError
from llmgw.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVEvent,
)

__all__ = ["DecodedBatch", "HashForm", "Shape", "decode_batch", "encode_batch"]

Shape = Literal["map", "array"]
HashForm = Literal["int", "bytes"]

_MASK64 = (1 << 64) - 1

_STORED_FIELDS: tuple[str, ...] = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_FIELDS: tuple[str, ...] = ("block_hashes", "medium", "group_idx", "locality", "ownership")
# Fields vLLM declares without a default: msgspec's omit_defaults still emits them as nil.
_STORED_REQUIRED = 7
_REMOVED_REQUIRED = 2


@dataclass(frozen=True, slots=True)
class _Layout:
    shape: Shape
    num_stored: int  # how many BlockStored fields this vLLM declares
    num_removed: int
    has_rank: bool  # the batch's third element (0.9.2+)


# First vLLM release of each wire layout -> layout (reference §1 field table).
_LAYOUTS: dict[tuple[int, int, int], _Layout] = {
    (0, 9, 0): _Layout("array", 5, 1, False),
    (0, 9, 2): _Layout("array", 5, 1, True),
    (0, 10, 2): _Layout("array", 6, 2, True),
    (0, 14, 0): _Layout("array", 7, 2, True),
    (0, 17, 0): _Layout("array", 8, 2, True),
    (0, 20, 0): _Layout("array", 9, 3, True),
    (0, 22, 0): _Layout("array", 11, 3, True),
    (0, 24, 0): _Layout("map", 11, 3, True),
    (0, 26, 0): _Layout("map", 12, 4, True),
    (0, 29, 0): _Layout("map", 13, 5, True),
    (0, 30, 0): _Layout("map", 14, 5, True),
    (0, 33, 0): _Layout("map", 15, 5, True),
}
# Defaults: the layouts of the reference's wire goldens (A: 0.18, B: 0.33).
_DEFAULT_VERSION: dict[Shape, tuple[int, int, int]] = {"array": (0, 17, 0), "map": (0, 33, 0)}


def _layout_for(shape: Shape | None, vllm_version: str | None) -> _Layout:
    if vllm_version is None:
        if shape not in (None, "map", "array"):
            raise KVError(f"shape {shape!r} is unknown; use 'map' (vLLM >= 0.24) or 'array'")
        return _LAYOUTS[_DEFAULT_VERSION[shape or "map"]]
    try:
        parts = tuple(int(p) for p in vllm_version.split(".")[:3])
    except ValueError:
        parts = ()
    if not parts:
        raise KVError(
            f"vllm_version {vllm_version!r} is not a version like '0.18' or '0.33.1'",
            field="vllm_version",
        )
    version = (*parts, 0, 0)[:3]
    known = [v for v in _LAYOUTS if v <= version]
    if not known:
        raise KVError(
            f"vllm_version {vllm_version!r} predates KV events (first in 0.9.0)",
            field="vllm_version",
        )
    layout = _LAYOUTS[max(known)]
    if shape is not None and shape != layout.shape:
        raise KVError(
            f"vLLM {vllm_version} encodes events as {layout.shape}s, not {shape}s; drop shape= "
            "or pick a version of the other shape (arrays up to 0.23, maps since 0.24)",
            field="shape",
        )
    return layout


# --- encoding ----------------------------------------------------------------------------------

_packb: Callable[[object], bytes] = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _map_header(n: int, declared: int) -> bytes:
    # msgspec sizes a struct's map header by its declared field count (plus the tag) before it
    # knows how many omit_defaults will drop: BlockStored in 0.33 (16 keys) gets map16 even with 9.
    if declared <= 15:
        return bytes((0x80 | n,))
    return b"\xde" + n.to_bytes(2, "big")


def _wire_hash(value: ExternalBlockHash, hash_form: HashForm) -> ExternalBlockHash:
    if isinstance(value, bytes):
        if hash_form == "int":
            return int.from_bytes(value[-8:], "big")
        return value
    if hash_form == "bytes":
        raise KVError(
            f"hash {value} is a 64-bit int; hash_form='bytes' needs the full 32-byte digests "
            "(pass BlockHash digests in the events, or use hash_form='int')",
            field="hash_form",
        )
    return value


def _event_values(
    event: BlockStored | BlockRemoved, names: tuple[str, ...], hash_form: HashForm
) -> list[Any]:
    values: list[Any] = []
    for name in names:
        value = getattr(event, name)
        if name == "block_hashes":
            value = [_wire_hash(h, hash_form) for h in value]
        elif name == "parent_block_hash" and value is not None:
            value = _wire_hash(value, hash_form)
        values.append(value)
    return values


def _encode_event(event: KVEvent, layout: _Layout, hash_form: HashForm) -> bytes:
    if isinstance(event, BlockStored):
        fields, required = _STORED_FIELDS, _STORED_REQUIRED
        declared = layout.num_stored
    elif isinstance(event, BlockRemoved):
        fields, required = _REMOVED_FIELDS, _REMOVED_REQUIRED
        declared = layout.num_removed
    elif isinstance(event, AllBlocksCleared):
        packed_tag = _packb("AllBlocksCleared")
        if layout.shape == "array":
            return b"\x91" + packed_tag
        return b"\x81" + _packb("type") + packed_tag
    else:
        raise KVError(
            f"cannot encode {event!r}: not a BlockStored, BlockRemoved or AllBlocksCleared"
        )
    tag = type(event).__name__
    for name in fields[declared:]:
        if getattr(event, name) is not None:
            # Dropping a set field would publish a different event than the caller built.
            raise KVError(
                f"{tag}.{name}={getattr(event, name)!r} does not exist in this vLLM layout "
                f"({layout.shape}, {declared} fields); pass a later vllm_version",
                field=name,
            )
    names = fields[:declared]
    values = _event_values(event, names, hash_form)
    if layout.shape == "array":
        return _array_header(declared + 1) + _packb(tag) + b"".join(map(_packb, values))
    parts = [_packb("type"), _packb(tag)]
    for i, (name, value) in enumerate(zip(names, values, strict=True)):
        if value is None and i >= required:
            continue
        parts.append(_packb(name))
        parts.append(_packb(value))
    return _map_header(len(parts) // 2, declared + 1) + b"".join(parts)


def encode_batch(
    batch: EventBatch,
    *,
    shape: Shape | None = None,
    hash_form: HashForm = "int",
    vllm_version: str | None = None,
) -> bytes:
    """The msgpack payload vLLM's publisher would send for ``batch``.

    ``shape`` picks the event encoding ("map", the default: vLLM 0.33; "array": vLLM 0.17-0.21
    with fields through ``extra_keys``); ``vllm_version`` picks any release's exact layout.
    ``hash_form="int"`` projects digests to uint64 as vLLM's default does.
    """
    if hash_form not in ("int", "bytes"):
        raise KVError(
            f"hash_form {hash_form!r} is unknown; use 'int' or 'bytes'", field="hash_form"
        )
    layout = _layout_for(shape, vllm_version)
    if not isinstance(batch.ts, float | int) or isinstance(batch.ts, bool):
        raise KVError(f"batch ts {batch.ts!r} is not a number of seconds", field="ts")
    try:
        events = b"".join(_encode_event(e, layout, hash_form) for e in batch.events)
        head = _packb(float(batch.ts)) + _array_header(len(batch.events))
        if layout.has_rank:
            return b"\x93" + head + events + _packb(batch.data_parallel_rank)
        return b"\x92" + head + events
    except (OverflowError, TypeError, ValueError) as exc:
        if isinstance(exc, KVError):
            raise
        # msgpack's own complaint (an int beyond 64 bits, an unpackable field value).
        raise KVError(
            f"batch cannot be encoded as msgpack ({type(exc).__name__}: {exc}); hashes are "
            "uint64 ints or digests, token ids non-negative ints"
        ) from None


# --- decoding ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """A decoded payload and how many events of unknown type it skipped."""

    batch: EventBatch
    num_skipped: int = 0

    @property
    def events(self) -> tuple[KVEvent, ...]:
        return self.batch.events


def _fail(what: str) -> KVDecodeError:
    return KVDecodeError(f"KV event payload is malformed: {what}")


# Bounded in depth and length: msgpack nests ~1000 levels deep, past Python's recursion
# limit, so a plain repr of a hostile value would raise RecursionError inside the error path.
_REPR = reprlib.Repr()  # keyword arguments arrived in 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 40, 40
_REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 6, 6, 4


def _short(value: object) -> str:
    return _REPR.repr(value)[:60]


def _int(value: object, where: str) -> int:
    if type(value) is not int:
        raise _fail(f"{where} is {type(value).__name__} {_short(value)}, expected an int")
    return value


def _block_size(value: object) -> int:
    # 0 is what offloaded (CPU-medium) blocks carry; a negative size is no
    # engine's, and would make token_ids / block_size arithmetic lie downstream.
    size = _int(value, "BlockStored.block_size")
    if size < 0:
        raise _fail(f"BlockStored.block_size is {size}, expected 0 or more")
    return size


def _opt_int(value: object, where: str) -> int | None:
    return None if value is None else _int(value, where)


def _opt_str(value: object, where: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _fail(f"{where} is {type(value).__name__} {_short(value)}, expected a string or nil")


def _hash(value: object, where: str, keep_bytes: bool) -> ExternalBlockHash:
    if isinstance(value, int) and not isinstance(value, bool):
        # vLLM 0.9.x's builtin hash is a signed int64: project it onto uint64 like consumers do.
        return value & _MASK64
    if isinstance(value, bytes):
        if len(value) < 8:
            raise _fail(f"{where} is a {len(value)}-byte hash, expected 8 or more")
        return value if keep_bytes else int.from_bytes(value[-8:], "big")
    raise _fail(f"{where} is {type(value).__name__} {_short(value)}, expected an int or bytes hash")


def _hashes(value: object, where: str, keep_bytes: bool) -> tuple[ExternalBlockHash, ...]:
    if type(value) is not list:
        raise _fail(f"{where} is {type(value).__name__}, expected an array of hashes")
    if keep_bytes:
        return tuple(_hash(h, where, True) for h in value)
    out: list[int] = []
    for h in value:
        if type(h) is int:
            out.append(h & _MASK64)
        else:
            out.append(_hash(h, where, False))  # type: ignore[arg-type]
    return tuple(out)


def _ints(value: object, where: str) -> tuple[int, ...]:
    if type(value) is not list:
        raise _fail(f"{where} is {type(value).__name__}, expected an array of ints")
    for v in value:
        if type(v) is not int:
            raise _fail(f"{where} holds {type(v).__name__} {_short(v)}, expected ints")
    return tuple(value)


# extra_keys nest two or three levels (a block's keys, a tagged key, an MM offset pair); a
# deeper value is junk, and refusing it keeps recursion far from Python's limit.
_MAX_EXTRA_DEPTH = 8


def _frozen(value: object, depth: int = 0) -> object:
    # Tuples (and maps as tuples of pairs) keep the event frozen and hashable.
    if depth > _MAX_EXTRA_DEPTH:
        raise _fail(f"BlockStored.extra_keys nests deeper than {_MAX_EXTRA_DEPTH} levels")
    if type(value) is list:
        return tuple(_frozen(v, depth + 1) for v in value)
    if type(value) is dict:
        return tuple((_frozen(k, depth + 1), _frozen(v, depth + 1)) for k, v in value.items())
    return value


def _stored(f: Sequence[object], keep_bytes: bool) -> BlockStored:
    parent = f[1]
    extra = f[7]
    if extra is not None and type(extra) is not list:
        raise _fail(f"BlockStored.extra_keys is {type(extra).__name__}, expected an array or nil")
    look = f[14]
    if look is not None:
        if type(look) is not list:
            raise _fail("BlockStored.lookahead_token_ids is not an array")
        look = tuple(_ints(x, "BlockStored.lookahead_token_ids") for x in look)
    return BlockStored(
        block_hashes=_hashes(f[0], "BlockStored.block_hashes", keep_bytes),
        parent_block_hash=None
        if parent is None
        else _hash(parent, "BlockStored.parent_block_hash", keep_bytes),
        token_ids=_ints(f[2], "BlockStored.token_ids"),
        block_size=_block_size(f[3]),
        lora_id=_opt_int(f[4], "BlockStored.lora_id"),
        medium=_opt_str(f[5], "BlockStored.medium"),
        lora_name=_opt_str(f[6], "BlockStored.lora_name"),
        extra_keys=None if extra is None else _frozen(extra),  # type: ignore[arg-type]
        group_idx=_opt_int(f[8], "BlockStored.group_idx"),
        kv_cache_spec_kind=_opt_str(f[9], "BlockStored.kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(f[10], "BlockStored.kv_cache_spec_sliding_window"),
        locality=_opt_str(f[11], "BlockStored.locality"),
        ownership=_opt_str(f[12], "BlockStored.ownership"),
        session_id=_opt_str(f[13], "BlockStored.session_id"),
        lookahead_token_ids=look,
    )


def _removed(f: Sequence[object], keep_bytes: bool) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f[0], "BlockRemoved.block_hashes", keep_bytes),
        medium=_opt_str(f[1], "BlockRemoved.medium"),
        group_idx=_opt_int(f[2], "BlockRemoved.group_idx"),
        locality=_opt_str(f[3], "BlockRemoved.locality"),
        ownership=_opt_str(f[4], "BlockRemoved.ownership"),
    )


_MIN_STORED = 4  # block_hashes, parent_block_hash, token_ids, block_size: in every release
_NONES = (None,) * 16


def _decode_event(raw: object, keep_bytes: bool) -> KVEvent | None:
    if type(raw) is list:
        if not raw or type(raw[0]) is not str:
            raise _fail(f"an array event must start with its type name, got {_short(raw[:1])}")
        tag = raw[0]
        if tag == "BlockStored":
            if len(raw) < 1 + _MIN_STORED:
                raise _fail(f"BlockStored array has {len(raw) - 1} fields, expected 4 or more")
            return _stored([*raw[1:16], *_NONES[: max(0, 16 - len(raw))]], keep_bytes)
        if tag == "BlockRemoved":
            if len(raw) < 2:
                raise _fail("BlockRemoved array has no block_hashes")
            return _removed([*raw[1:6], *_NONES[: max(0, 6 - len(raw))]], keep_bytes)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if type(raw) is dict:
        map_tag = raw.get("type")
        if type(map_tag) is not str:
            raise _fail(f"a map event needs a string 'type', got {_short(map_tag)}")
        tag = map_tag
        if tag == "BlockStored":
            for key in ("block_hashes", "token_ids", "block_size"):
                if key not in raw:
                    raise _fail(f"BlockStored map lacks {key!r}")
            return _stored([raw.get(name) for name in _STORED_FIELDS], keep_bytes)
        if tag == "BlockRemoved":
            if "block_hashes" not in raw:
                raise _fail("BlockRemoved map lacks 'block_hashes'")
            return _removed([raw.get(name) for name in _REMOVED_FIELDS], keep_bytes)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise _fail(f"an event is {type(raw).__name__} {_short(raw)}, expected an array or a map")


def decode_batch(payload: bytes, *, hash_form: Literal["int", "raw"] = "int") -> DecodedBatch:
    """Parse a ``KVEventBatch`` payload of any vLLM release into typed events.

    ``hash_form="int"`` turns every hash into the uint64 key events carry by default (a digest
    becomes its last 8 bytes), so mirrors and indexes see one form whatever the engine sends;
    ``"raw"`` keeps digests as bytes.
    """
    if hash_form not in ("int", "raw"):
        raise KVDecodeError(f"hash_form {hash_form!r} is unknown; use 'int' or 'raw'")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise KVDecodeError(f"KV event payload is {type(payload).__name__}, expected bytes")
    try:
        top = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:
        # msgpack raises a version-dependent mix (ExtraData, FormatError, StackError,
        # UnicodeDecodeError, TypeError for unhashable keys, ...): one type for callers.
        raise KVDecodeError(
            f"KV event payload is not valid msgpack ({type(exc).__name__}: {exc!s:.80})"
        ) from None
    if type(top) is not list or len(top) < 2:
        raise _fail(f"a batch is an array [ts, events, dp_rank], got {_short(top)}")
    ts = top[0]
    if type(ts) not in (float, int) or (type(ts) is float and not math.isfinite(ts)):
        raise _fail(f"batch ts is {_short(ts)}, expected a finite number")
    raw_events = top[1]
    if type(raw_events) is not list:
        raise _fail(f"batch events is {type(raw_events).__name__}, expected an array")
    rank = _opt_int(top[2], "batch data_parallel_rank") if len(top) > 2 else None
    keep_bytes = hash_form == "raw"
    events: list[KVEvent] = []
    skipped = 0
    for raw in raw_events:
        event = _decode_event(raw, keep_bytes)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return DecodedBatch(EventBatch(float(ts), tuple(events), rank), skipped)
