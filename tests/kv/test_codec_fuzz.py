"""The decoder faces the network: fuzz it, and round-trip the encoder through it."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVDecodeError,
    decode_batch,
    decode_message,
    decode_replay_reply,
    decode_replay_request,
    encode_batch,
)

_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"]),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(
            st.one_of(
                st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "medium"]),
                st.text(max_size=6),
                st.integers(-(2**63), 2**64 - 1),
            ),
            inner,
            max_size=6,
        ),
    ),
    max_leaves=30,
)
_event_like = st.one_of(
    _value,
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])).flatmap(
        lambda t: st.lists(_value, max_size=16).map(lambda rest: [t[0], *rest])
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
        optional={
            "block_hashes": _value,
            "parent_block_hash": _value,
            "token_ids": _value,
            "block_size": _value,
            "medium": _value,
            "extra_keys": _value,
            "lookahead_token_ids": _value,
            "group_idx": _value,
        },
    ),
)
_batch_like = st.one_of(
    _value,
    st.tuples(_value, st.lists(_event_like, max_size=5), _value).map(list),
    st.tuples(st.floats(), st.lists(_event_like, max_size=5)).map(list),
)


def _decode_or_own_error(payload: bytes) -> None:
    # Each form on its own: the first refusing must not skip the second.
    for form in ("int", "raw"):
        with contextlib.suppress(KVDecodeError):
            decode_batch(payload, hash_form=form)  # type: ignore[arg-type]


def _nested(depth: int, leaf: object = None) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "payload",
    [
        # msgpack nests ~1000 deep, past Python's recursion limit: the decoder and the
        # repr in its own error messages must both stay bounded.
        b"\x91" * 1000 + b"\xc0",
        b"\x92\x01" + b"\x91" * 1000 + b"\xc0",
        msgpack.packb(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [1] * 4,
                        "block_size": 4,
                        "lora_id": None,
                        "medium": None,
                        "lora_name": None,
                        "extra_keys": _nested(900, 1),
                    }
                ],
                0,
            ]
        ),
    ],
)
def test_deep_nesting_is_refused_with_own_error(payload: bytes) -> None:
    for form in ("int", "raw"):
        with pytest.raises(KVDecodeError):
            decode_batch(payload, hash_form=form)  # type: ignore[arg-type]


def test_map_extra_keys_decode_to_a_hashable_event() -> None:
    doc = [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [1] * 4,
                "block_size": 4,
                "lora_id": None,
                "medium": None,
                "lora_name": None,
                "extra_keys": [{"k": b"v"}],
            }
        ],
        0,
    ]
    event = decode_batch(msgpack.packb(doc, use_bin_type=True)).events[0]
    assert hash(event) == hash(event)


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    _decode_or_own_error(data)


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_batch_like)
def test_structured_garbage(doc: object) -> None:
    _decode_or_own_error(msgpack.packb(doc, use_bin_type=True))


_GOLDEN_MAP = encode_batch(
    EventBatch(
        1.0,
        (
            BlockStored((1, 2), 3, tuple(range(8)), 4, medium="GPU", extra_keys=(("a",), None)),
            BlockRemoved((5,), "CPU"),
            AllBlocksCleared(),
        ),
    )
)


@settings(deadline=None, max_examples=400)
@given(
    cut=st.integers(0, len(_GOLDEN_MAP)),
    flips=st.lists(
        st.tuples(st.integers(0, len(_GOLDEN_MAP) - 1), st.integers(0, 255)), max_size=4
    ),
)
def test_mutated_valid_payloads(cut: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(_GOLDEN_MAP)
    for pos, byte in flips:
        data[pos] = byte
    _decode_or_own_error(bytes(data[:cut]))
    _decode_or_own_error(bytes(data))


@settings(deadline=None, max_examples=300)
@given(frames=st.lists(st.one_of(st.binary(max_size=10), st.none(), st.integers()), max_size=5))
def test_frame_decoders(frames: list[object]) -> None:
    for decoder in (decode_message, decode_replay_reply, decode_replay_request):
        with contextlib.suppress(KVDecodeError):
            decoder(frames)  # type: ignore[operator]


_u64 = st.integers(0, 2**64 - 1)
_opt_str = st.one_of(st.none(), st.text(max_size=6))
_opt_int = st.one_of(st.none(), st.integers(0, 2**31))
_stored = st.builds(
    BlockStored,
    block_hashes=st.lists(_u64, max_size=3).map(tuple),
    parent_block_hash=st.one_of(st.none(), _u64),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=20).map(tuple),
    block_size=st.integers(0, 256),
    lora_id=_opt_int,
    medium=_opt_str,
    lora_name=_opt_str,
    extra_keys=st.one_of(
        st.none(),
        st.lists(st.one_of(st.none(), st.tuples(st.text(max_size=3))), max_size=3).map(tuple),
    ),
    group_idx=_opt_int,
    kv_cache_spec_kind=_opt_str,
    kv_cache_spec_sliding_window=_opt_int,
    locality=_opt_str,
    ownership=_opt_str,
    session_id=_opt_str,
    lookahead_token_ids=st.one_of(
        st.none(),
        st.lists(st.lists(st.integers(0, 99), max_size=3).map(tuple), max_size=2).map(tuple),
    ),
)
_removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(_u64, max_size=3).map(tuple),
    medium=_opt_str,
    group_idx=_opt_int,
    locality=_opt_str,
    ownership=_opt_str,
)
_events = st.lists(st.one_of(_stored, _removed, st.just(AllBlocksCleared())), max_size=4).map(tuple)


@settings(deadline=None, max_examples=200)
@given(
    events=_events,
    ts=st.floats(0, 2e9),
    rank=st.integers(0, 7),
    shape=st.sampled_from(["map", "array"]),
)
def test_round_trip_newest_layouts(events: tuple, ts: float, rank: int, shape: str) -> None:  # type: ignore[type-arg]
    batch = EventBatch(ts, events, rank)
    version = "0.33" if shape == "map" else "0.23"
    if shape == "array":
        # Positional arrays end at 0.22's fields: later ones cannot be encoded that way.
        batch = EventBatch(
            ts,
            tuple(
                BlockStored(*[getattr(e, f) for f in e.__slots__[:11]])  # type: ignore[union-attr]
                if isinstance(e, BlockStored)
                else BlockRemoved(*[getattr(e, f) for f in e.__slots__[:3]])  # type: ignore[union-attr]
                if isinstance(e, BlockRemoved)
                else e
                for e in events
            ),
            rank,
        )
    decoded = decode_batch(encode_batch(batch, vllm_version=version))
    assert decoded.batch == batch and decoded.num_skipped == 0
