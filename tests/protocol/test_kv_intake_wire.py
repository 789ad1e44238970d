"""The KV-delta wire (llmgw.protocol.kvstream): round trips, bounds, malformed bodies refused."""

from __future__ import annotations

from array import array

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.protocol.kvstream import (
    KV_PATH,
    MAX_BLOCKS_PER_MESSAGE,
    MAX_BODY_BYTES,
    KvDeltaRequest,
    KvStreamError,
    chunk_change,
    decode_kv_request,
    decode_kv_response,
    encode_kv_request,
    encode_kv_response,
    pack_hashes,
    unpack_hashes,
)

U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
MEDIA = st.sampled_from(["GPU", "CPU", "STORAGE"])


def test_route_is_the_sync_modules() -> None:
    from llmgw.protocol import sync

    assert KV_PATH == sync.KV_PATH == "/agent/v1/kv"


def test_hashes_are_packed_big_endian_8_bytes_each() -> None:
    assert pack_hashes([1, (1 << 64) - 1]) == b"\x00" * 7 + b"\x01" + b"\xff" * 8
    assert list(unpack_hashes(b"\x00" * 7 + b"\x02")) == [2]
    with pytest.raises(KvStreamError, match="8-byte"):
        unpack_hashes(b"\x00" * 9)
    with pytest.raises(KvStreamError, match="64-bit"):
        pack_hashes([1 << 64])


@given(
    added=st.dictionaries(MEDIA, st.lists(U64, max_size=50), max_size=3),
    removed=st.dictionaries(MEDIA, st.lists(U64, max_size=50), max_size=3),
    base=st.integers(0, 1 << 40),
    step=st.integers(0, 1000),
    complete=st.booleans(),
    partial=st.booleans(),
    block_size=st.none() | st.integers(0, 1024),
)
def test_requests_round_trip(
    added: dict[str, list[int]],
    removed: dict[str, list[int]],
    base: int,
    step: int,
    complete: bool,
    partial: bool,
    block_size: int | None,
) -> None:
    request = KvDeltaRequest(
        shard_id="shard-a",
        base_version=base,
        new_version=base + step,
        complete=complete,
        partial=partial,
        block_size=block_size,
        added={m: array("Q", h) for m, h in added.items()},
        removed={m: array("Q", h) for m, h in removed.items()},
    )
    assert decode_kv_request(encode_kv_request(request)) == request


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\xc1", "not a valid msgpack"),
        (msgpack.packb([1, 2]), "msgpack map"),
        (msgpack.packb("text"), "must be a msgpack map"),
        (msgpack.packb({"v": 1, "shard_id": "s"}), "lacks"),
        (
            msgpack.packb({"v": 2, "shard_id": "s", "base_version": 0, "new_version": 1}),
            "version 2",
        ),
        (msgpack.packb({"v": 1, "shard_id": "", "base_version": 0, "new_version": 1}), "shard_id"),
        (
            msgpack.packb({"v": 1, "shard_id": "s", "base_version": -1, "new_version": 1}),
            "base_version",
        ),
        (
            msgpack.packb({"v": 1, "shard_id": "s", "base_version": 5, "new_version": 4}),
            "only move forward",
        ),
        (
            msgpack.packb(
                {"v": 1, "shard_id": "s", "base_version": 0, "new_version": 1, "reset": 1}
            ),
            "boolean",
        ),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "shard_id": "s",
                    "base_version": 0,
                    "new_version": 1,
                    "added": {"GPU": [1]},
                }
            ),
            "not a valid msgpack",  # arrays are refused by the parser's limits
        ),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "shard_id": "s",
                    "base_version": 0,
                    "new_version": 1,
                    "added": {"GPU": b"x"},
                }
            ),
            "8-byte",
        ),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "shard_id": "s",
                    "base_version": 0,
                    "new_version": 1,
                    "reset": True,
                    "removed": {"GPU": pack_hashes([1])},
                }
            ),
            "must be empty",
        ),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "shard_id": "s",
                    "base_version": 0,
                    "new_version": 1,
                    "added": {f"m{i}": b"" for i in range(9)},
                }
            ),
            "media",
        ),
    ],
)
def test_malformed_bodies_are_refused_with_one_error_type(body: bytes, match: str) -> None:
    with pytest.raises(KvStreamError, match=match):
        decode_kv_request(body)


def test_oversize_bodies_and_requests_are_refused() -> None:
    with pytest.raises(KvStreamError, match="cap"):
        decode_kv_request(b"\x00" * (MAX_BODY_BYTES + 1))
    big = KvDeltaRequest("s", 0, 1, added={"GPU": array("Q", range(MAX_BLOCKS_PER_MESSAGE + 1))})
    with pytest.raises(KvStreamError, match="chunk_change"):
        encode_kv_request(big)
    exact = KvDeltaRequest("s", 0, 1, added={"GPU": array("Q", range(MAX_BLOCKS_PER_MESSAGE))})
    assert len(encode_kv_request(exact)) <= MAX_BODY_BYTES


@given(
    added=st.dictionaries(MEDIA, st.sets(U64, max_size=40).map(sorted), max_size=3),
    removed=st.dictionaries(MEDIA, st.sets(U64, max_size=40).map(sorted), max_size=3),
    reset=st.booleans(),
    max_blocks=st.integers(1, 17),
)
def test_chunks_carry_the_change_exactly_once_and_only_the_last_is_complete(
    added: dict[str, list[int]], removed: dict[str, list[int]], reset: bool, max_blocks: int
) -> None:
    if reset:
        removed = {}
    chunks = chunk_change(
        shard_id="s",
        base_version=3,
        new_version=9,
        reset=reset,
        partial=False,
        block_size=16,
        added={m: tuple(h) for m, h in added.items()},
        removed={m: tuple(h) for m, h in removed.items()},
        max_blocks=max_blocks,
    )
    assert [c.complete for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[0].base_version == 3 and chunks[0].reset == reset
    assert all(c.base_version == 9 and not c.reset for c in chunks[1:])
    assert all(c.num_blocks <= max_blocks for c in chunks)
    got_added: dict[str, list[int]] = {}
    got_removed: dict[str, list[int]] = {}
    for c in chunks:
        decode_kv_request(encode_kv_request(c))
        for m, h in c.added.items():
            got_added.setdefault(m, []).extend(h)
        for m, h in c.removed.items():
            got_removed.setdefault(m, []).extend(h)
    assert got_added == {m: h for m, h in added.items() if h}
    assert got_removed == {m: h for m, h in removed.items() if h}


def test_responses_round_trip_and_unknown_results_are_refused() -> None:
    for result in ("ack", "retry", "need_full"):
        assert decode_kv_response(encode_kv_response(result)) == result
    with pytest.raises(KvStreamError, match="not one of"):
        decode_kv_response(b'{"result": "maybe"}')
    with pytest.raises(KvStreamError, match="is not"):
        decode_kv_response(b"<html>")
