"""The KV event codec against the reference's wire goldens, plus round trips and frames."""

from __future__ import annotations

import msgpack
import pytest

from llmgw.kv import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVDecodeError,
    KVError,
    block_hashes,
    decode_batch,
    decode_message,
    decode_replay_reply,
    decode_replay_request,
    encode_batch,
    encode_message,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
    hash64,
)

GOLDEN_A = bytes.fromhex(
    "93cb3ff80000000000009199ab426c6f636b53746f72656491cf2ceabcfae6d332eac0dc0010010203040506"
    "0708090a0b0c0d0e0f1010c0a3475055c0c000"
)
GOLDEN_B = bytes.fromhex(
    "93cb3ff800000000000091de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "91cf2ceabcfae6d332eab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00100102"
    "030405060708090a0b0c0d0e0f10aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da347"
    "5055a96c6f72615f6e616d65c0a967726f75705f6964780000"
)


def _ex1_block0(**kw: object) -> BlockStored:
    digest = block_hashes(list(range(1, 17)), 16, seed="0")[0]
    return BlockStored((digest,), None, tuple(range(1, 17)), 16, medium="GPU", **kw)  # type: ignore[arg-type]


def test_golden_a_positional_array() -> None:
    assert encode_batch(EventBatch(1.5, (_ex1_block0(),)), shape="array") == GOLDEN_A
    assert encode_batch(EventBatch(1.5, (_ex1_block0(),)), vllm_version="0.18.1") == GOLDEN_A


def test_golden_b_tagged_map() -> None:
    assert encode_batch(EventBatch(1.5, (_ex1_block0(group_idx=0),))) == GOLDEN_B
    assert (
        encode_batch(EventBatch(1.5, (_ex1_block0(group_idx=0),)), vllm_version="0.33") == GOLDEN_B
    )


@pytest.mark.parametrize("golden", [GOLDEN_A, GOLDEN_B])
def test_goldens_decode(golden: bytes) -> None:
    decoded = decode_batch(golden)
    assert decoded.num_skipped == 0
    assert decoded.batch.ts == 1.5 and decoded.batch.data_parallel_rank == 0
    (ev,) = decoded.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (3236607068019569386,)
    assert ev.token_ids == tuple(range(1, 17)) and ev.block_size == 16 and ev.medium == "GPU"


def test_bytes_hash_form_round_trip() -> None:
    digests = block_hashes(list(range(1, 33)), 16, seed="0")
    batch = EventBatch(
        2.0,
        (
            BlockStored((digests[1],), digests[0], tuple(range(17, 33)), 16, medium="GPU"),
            BlockRemoved((digests[0],), medium="GPU"),
            AllBlocksCleared(),
        ),
    )
    for shape in ("map", "array"):
        payload = encode_batch(batch, shape=shape, hash_form="bytes")  # type: ignore[arg-type]
        assert decode_batch(payload, hash_form="raw").batch == batch
        ints = decode_batch(payload).events
        assert ints[0].block_hashes == (hash64(digests[1]),)  # type: ignore[union-attr]
        assert ints[0].parent_block_hash == hash64(digests[0])  # type: ignore[union-attr]
    with pytest.raises(KVError, match="hash_form"):
        encode_batch(EventBatch(1.0, (BlockRemoved((5,)),)), hash_form="bytes")


def test_unknown_tags_are_skipped_and_counted() -> None:
    payload = msgpack.packb([1.0, [["FutureEvent", 1], {"type": "Other"}, ["AllBlocksCleared"]], 0])
    decoded = decode_batch(payload)
    assert decoded.num_skipped == 2
    assert decoded.events == (AllBlocksCleared(),)


def test_later_fields_and_extra_elements_are_tolerated() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "field_from_0_40": [1, 2, 3],
    }
    arr = ["BlockRemoved", [-1], "GPU", 0, "LOCAL", "me", "from-the-future"]
    decoded = decode_batch(msgpack.packb([3.0, [stored, arr], 1, "extra"]))
    assert decoded.events[0] == BlockStored((1,), None, (1, 2), 2, medium="CPU")
    # vLLM 0.9's builtin hash is a signed int64: it projects onto uint64.
    assert decoded.events[1] == BlockRemoved((2**64 - 1,), "GPU", 0, "LOCAL", "me")
    assert decoded.batch.data_parallel_rank == 1


def test_vllm_090_two_element_batch() -> None:
    batch = EventBatch(1.0, (BlockStored((5,), None, (1,), 1, lora_id=3),), None)
    payload = encode_batch(batch, vllm_version="0.9.0")
    assert msgpack.unpackb(payload) == [1.0, [["BlockStored", [5], None, [1], 1, 3]]]
    assert decode_batch(payload).batch == batch
    with pytest.raises(KVError, match="medium"):
        encode_batch(EventBatch(1.0, (BlockRemoved((5,), medium="GPU"),)), vllm_version="0.9")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb({"a": 1}),
        msgpack.packb([1.0]),
        msgpack.packb(["x", []]),
        msgpack.packb([1.0, [["BlockStored", [1]]]]),
        msgpack.packb([1.0, [["BlockStored", ["h"], None, [], 0]]]),
        msgpack.packb([1.0, [["BlockStored", [b"short"], None, [], 0]]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgpack.packb([1.0, [{"type": 3}]]),
        msgpack.packb([1.0, [7]]),
        msgpack.packb([1.0, [["BlockStored", [True], None, [], 0]]]),
        msgpack.packb([float("nan"), []]),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(KVDecodeError):
        decode_batch(payload)


def test_live_message_frames() -> None:
    frames = encode_message("kv@s1", 258, b"payload")
    assert frames == [b"kv@s1", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"payload"]
    msg = decode_message(frames)
    assert (msg.topic, msg.seq, msg.payload) == ("kv@s1", 258, b"payload")
    for bad in ([b"t", b"\x00" * 7, b""], [b"t", b""], [b"\xff\xfe", b"\x00" * 8, b""]):
        with pytest.raises(KVDecodeError):
            decode_message(bad)


def test_replay_frames_both_shapes() -> None:
    req = encode_replay_request(7)
    assert req == [b"", b"\x00" * 7 + b"\x07"]
    assert decode_replay_request(req).start_seq == 7
    routed = decode_replay_request([b"id", *req])
    assert (routed.identity, routed.start_seq) == (b"id", 7)

    old = decode_replay_reply(encode_replay_reply(7, b"p", topic=None))
    assert (old.seq, old.payload, old.topic, old.is_end) == (7, b"p", None, False)
    new = decode_replay_reply(encode_replay_reply(8, b"q", topic="kv@s"))
    assert (new.seq, new.payload, new.topic, new.is_end) == (8, b"q", "kv@s", False)
    assert encode_replay_end(with_topic=False) == [b"", b"\xff" * 8, b""]
    assert encode_replay_end(with_topic=True) == [b"", b"", b"\xff" * 8, b""]
    for with_topic in (False, True):
        end = decode_replay_reply(encode_replay_end(with_topic=with_topic))
        assert end.is_end and end.seq == END_SEQ
    assert encode_replay_reply(1, b"", topic="t", identity=b"id")[0] == b"id"
