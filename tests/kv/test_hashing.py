"""Block hashing against the reference's worked examples (§6) and a naive cbor2 chain."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kv import (
    BlockHasher,
    KVError,
    block_hashes,
    extra_keys_for_block,
    hash64,
    hashing,
    none_hash,
)
from llmgw.kv.hashing import hash_block, scorable_blocks
from tests.kv.naive import naive_block_hashes

EX1_ROOT = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
EX1 = [
    ("202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea", 3236607068019569386),
    ("4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf", 2758186210834249151),
]
EX2_ROOT = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
EX2 = [
    ("c78a554a1b648c084577886fa29e20b89d606beb26cafd7f90ba7482f31901bc", 10428775992902877628),
    ("ce46e4cdf9f7c965a59bd3429627f27c1400980fc64be5e6706e1a9c55f39878", 8101442038445348984),
    ("2441f618186a645f56c3898f753a836f1e3dab0ae51494ac7ffdff5408e1a2ee", 9222808348315984622),
]


def test_ex1_seed_0_both_forms() -> None:
    assert none_hash("0").hex() == EX1_ROOT
    # The reference spells out block 0's CBOR: prefix, root, 16 tokens, nil extra.
    cbor = cbor2.dumps((none_hash("0"), tuple(range(1, 17)), None), canonical=True)
    assert cbor.hex() == "835820" + EX1_ROOT + "900102030405060708090a0b0c0d0e0f10" + "f6"
    got = block_hashes(list(range(1, 33)), 16, seed="0")
    assert [(h.hex(), hash64(h)) for h in got] == EX1


def test_ex2_unset_seed_uses_vllm_default() -> None:
    assert none_hash(None).hex() == EX2_ROOT
    got = block_hashes(list(range(100, 148)), 16)
    assert [(h.hex(), hash64(h)) for h in got] == EX2


@pytest.mark.parametrize(
    ("salt", "fmt", "prefixes", "ints"),
    [
        (None, "tagged", ("c9d58ba6", "24125b23"), [2164874634404590027, 17270480062156288726]),
        (
            "tenant-a",
            "legacy",
            ("5188afdf", "d6ebcd87"),
            [13195198002585232116, 802162569614849407],
        ),
        (
            "tenant-a",
            "tagged",
            ("6d7c30cb", "d2372500"),
            [16580576289588873832, 12602710988629408670],
        ),
    ],
)
def test_ex3_block4_partial_tail_and_salt(
    salt: str | None, fmt: str, prefixes: tuple[str, str], ints: list[int]
) -> None:
    got = block_hashes(list(range(1, 10)), 4, seed="0", cache_salt=salt, extra_key_format=fmt)  # type: ignore[arg-type]
    assert len(got) == 2  # token 9 is a partial block: never hashed
    assert [h.hex()[:8] for h in got] == list(prefixes)
    assert [hash64(h) for h in got] == ints


def test_extra_keys_forms() -> None:
    assert extra_keys_for_block(0) is None
    assert extra_keys_for_block(0, cache_salt="s") == (("cache_salt", "s"),)
    assert extra_keys_for_block(1, cache_salt="s") is None
    assert extra_keys_for_block(0, lora_name="a", lora_path="/p", cache_salt="s") == (
        ("lora", "a", "/p"),
        ("cache_salt", "s"),
    )
    assert extra_keys_for_block(3, lora_name="a", extra_key_format="legacy") == ("a",)
    with pytest.raises(KVError, match="lora_path"):
        extra_keys_for_block(0, lora_name="a")
    with pytest.raises(KVError, match="string"):
        none_hash(0)  # type: ignore[arg-type]


def test_lora_against_naive() -> None:
    toks = list(range(5000, 5100))
    got = block_hashes(toks, 16, seed="7", lora_name="ad", lora_path="/m/ad", cache_salt="x")
    assert got == naive_block_hashes(toks, 16, "7", ("ad", "/m/ad"), "x")
    got = block_hashes(toks, 16, seed="7", lora_name="ad", extra_key_format="legacy")
    assert got == naive_block_hashes(toks, 16, "7", ("ad", ""), None, tagged=False)


def test_hash_block_is_one_link() -> None:
    root = none_hash("0")
    assert hash_block(root, range(1, 17), None).hex() == EX1[0][0]


_tokens = st.lists(
    st.one_of(
        st.integers(0, 30),
        st.integers(0, 300),
        st.integers(0, 70000),
        st.integers(0, 2**32 + 5),
        st.integers(0, 2**64 - 1),
    ),
    max_size=120,
)


@settings(deadline=None, max_examples=150)
@given(
    tokens=_tokens,
    block_size=st.sampled_from([1, 2, 3, 4, 16, 23, 24, 25]),
    seed=st.one_of(st.none(), st.text(max_size=5)),
    salt=st.one_of(st.none(), st.text(max_size=5)),
)
def test_fast_path_matches_naive(
    tokens: list[int], block_size: int, seed: str | None, salt: str | None
) -> None:
    hasher = BlockHasher(block_size, seed=seed, cache_salt=salt)
    expected = naive_block_hashes(tokens, block_size, seed, None, salt)
    assert hasher.hashes(tokens) == expected
    # Warm: the memo must give the same chain, also for a prompt that extends a seen one.
    assert hasher.hashes(tokens) == expected
    longer = tokens + [7] * block_size
    assert hasher.hashes(longer) == naive_block_hashes(longer, block_size, seed, None, salt)


def test_marker_encoding_has_no_border() -> None:
    # Two occurrences of a border-free string cannot overlap: the split count check is exact.
    enc = hashing._MARKER_CBOR
    assert all(enc[:k] != enc[-k:] for k in range(1, len(enc)))


def test_memo_is_bounded_and_stays_exact() -> None:
    hasher = BlockHasher(4, seed="1", memo_blocks=32)
    prompts = [[p, *range(100, 100 + 60)] for p in range(30)]
    for p in prompts + prompts[::-1]:
        assert hasher.hashes(p) == naive_block_hashes(p, 4, "1")
        assert len(hasher._young) + len(hasher._old) <= 2 * hasher._memo_max + 8


def test_warm_prefix_then_divergent_tail() -> None:
    hasher = BlockHasher(16, seed="0")
    base = list(range(1000, 1000 + 16 * 20))
    hasher.hashes(base)
    for cut in (0, 5 * 16 + 3, 8 * 16, 17 * 16):
        other = [*base[:cut], 7, *base[cut + 1 :]]
        assert hasher.hashes(other) == naive_block_hashes(other, 16, "0")


def test_scorable_blocks_skips_a_last_block_that_cannot_hit() -> None:
    assert scorable_blocks(32, 16) == 1
    assert scorable_blocks(33, 16) == 2
    assert scorable_blocks(0, 16) == 0 and scorable_blocks(1, 16) == 0


def test_hasher_cache_is_a_bounded_lru() -> None:
    from llmgw.kv import hashing

    hashing._hasher.cache_clear()
    tokens = list(range(1, 33))
    first = block_hashes(tokens, 16, seed="1")
    info = hashing._hasher.cache_info()
    assert (info.maxsize, info.currsize, info.misses) == (hashing._HASHERS_MAX, 1, 1)
    for s in range(2, hashing._HASHERS_MAX + 1):  # fill it; seed "1" stays most recent
        block_hashes(tokens, 16, seed=str(s))
        block_hashes(tokens, 16, seed="1")
    block_hashes(tokens, 16, seed="overflow")  # evicts the least recently used: seed "2"
    assert hashing._hasher.cache_info().currsize == hashing._HASHERS_MAX
    before = hashing._hasher.cache_info().misses
    assert block_hashes(tokens, 16, seed="1") == first  # still cached
    assert hashing._hasher.cache_info().misses == before
    block_hashes(tokens, 16, seed="2")
    assert hashing._hasher.cache_info().misses == before + 1
    # A bad parameter is reported, never cached.
    with pytest.raises(KVError):
        block_hashes(tokens, 0)
    with pytest.raises(KVError):
        block_hashes(tokens, 16, seed=["not", "hashable"])  # type: ignore[arg-type]
