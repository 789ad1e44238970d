"""The router's prefix index against a plain per-shard-set model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kv import BlockMirror, BlockStored, EventBatch, KVError, PrefixIndex
from llmgw.kv import index as index_module
from llmgw.kv.mirror import MirrorSnapshot


def test_leading_blocks_only() -> None:
    idx = PrefixIndex()
    idx.apply_delta("m", "a", [1, 2, 3, 4])
    idx.apply_delta("m", "b", [1, 2, 4])  # holds block 4 but not 3: the run stops at 3
    idx.apply_delta("m", "c", [2, 3, 4])  # no first block: nothing counts
    got = idx.score("m", [1, 2, 3, 4], ["a", "b", "c", "nobody"])
    assert {k: v.matched_blocks for k, v in got.items()} == {"a": 4, "b": 2, "c": 0, "nobody": 0}
    assert got["b"].share == 0.5 and not got["a"].partial


def test_blocks_lists_one_shards_view_per_medium() -> None:
    idx = PrefixIndex()
    idx.apply_delta("m", "a", [3, 1, 2])
    idx.apply_delta("m", "b", [2, 9])
    idx.apply_delta("m", "a", [7], medium="cpu")
    idx.apply_delta("m", "a", removed=[2])
    idx.drop_shard("b")  # a retired slot's bits must not leak into a live shard's listing
    idx.apply_delta("m", "c", [5])
    assert idx.blocks("a") == {"GPU": [1, 3], "CPU": [7]}
    assert idx.blocks("c") == {"GPU": [5]}
    assert idx.blocks("nobody") == {}


def test_media_are_separate_and_selectable() -> None:
    idx = PrefixIndex()
    idx.apply_delta("m", "a", [1], medium="GPU")
    idx.apply_delta("m", "a", [2], medium="cpu")
    assert idx.score("m", [1, 2], ["a"])["a"].matched_blocks == 2
    assert idx.score("m", [1, 2], ["a"], media=["GPU"])["a"].matched_blocks == 1
    idx.apply_delta("m", "a", removed=[2], medium="CPU")
    assert idx.score("m", [1, 2], ["a"])["a"].matched_blocks == 1


def test_snapshot_replaces_and_drop_forgets() -> None:
    idx = PrefixIndex()
    idx.apply_delta("m", "a", [1, 2, 3])
    idx.apply_delta("m", "b", [1, 2, 3])
    idx.apply_snapshot("m", "a", {"GPU": [9]}, partial=True)
    assert idx.num_blocks("a") == 1 and idx.is_partial("a")
    assert idx.score("m", [1, 2], ["a", "b"])["a"].matched_blocks == 0
    assert idx.score("m", [9], ["a"])["a"].partial
    idx.drop_shard("b")
    assert idx.shards("m") == ["a"] and idx.score("m", [1], ["b"])["b"].matched_blocks == 0
    idx.compact()
    assert idx.num_entries("m") == 1


def test_shard_belongs_to_one_model() -> None:
    idx = PrefixIndex()
    idx.apply_delta("m", "a", [1])
    try:
        idx.apply_delta("other", "a", [1])
    except KVError as exc:
        assert "drop_shard" in str(exc)
    else:
        raise AssertionError("a shard moved between models silently")


def test_mirror_changes_feed_the_index() -> None:
    mirror, idx = BlockMirror(), PrefixIndex()
    mirror.apply(0, EventBatch(0.0, (BlockStored((1, 2), None, (), 0),)))
    idx.apply_change("m", "a", mirror.changes_since(0))
    assert idx.score("m", [1, 2], ["a"])["a"].matched_blocks == 2
    mirror.engine_started()
    change = mirror.changes_since(1)
    assert isinstance(change, MirrorSnapshot)
    idx.apply_change("m", "a", change)
    assert idx.score("m", [1, 2], ["a"])["a"].matched_blocks == 0


_shard = st.sampled_from(["s0", "s1", "s2", "s3", "s4"])
_hashes = st.lists(st.integers(0, 12), max_size=6)
_op = st.one_of(
    st.tuples(st.just("delta"), _shard, _hashes, _hashes),
    st.tuples(st.just("snapshot"), _shard, _hashes, st.just([])),
    st.tuples(st.just("drop"), _shard, st.just([]), st.just([])),
)


@settings(deadline=None, max_examples=300)
@given(ops=st.lists(_op, max_size=40), prompt=st.lists(st.integers(0, 12), max_size=8))
def test_index_matches_per_shard_sets(
    ops: list[tuple[str, str, list[int], list[int]]], prompt: list[int]
) -> None:
    # Compact on every retirement so slot reuse after compaction is exercised too.
    saved, index_module._GARBAGE_MIN = index_module._GARBAGE_MIN, 0
    try:
        _check_against_sets(ops, prompt)
    finally:
        index_module._GARBAGE_MIN = saved


def _check_against_sets(
    ops: list[tuple[str, str, list[int], list[int]]], prompt: list[int]
) -> None:
    idx = PrefixIndex()
    model: dict[str, set[int]] = {}
    for kind, shard, a, b in ops:
        if kind == "delta":
            idx.apply_delta("m", shard, a, b)
            held = model.setdefault(shard, set())
            held.difference_update(b)
            held.update(a)
        elif kind == "snapshot":
            idx.apply_snapshot("m", shard, {"GPU": a})
            model[shard] = set(a)
        else:
            idx.drop_shard(shard)
            model.pop(shard, None)
        for s, held in model.items():
            assert idx.num_blocks(s) == len(held)
    shards = ["s0", "s1", "s2", "s3", "s4"]
    got = idx.score("m", prompt, shards)
    for s in shards:
        held = model.get(s, set())
        n = 0
        while n < len(prompt) and prompt[n] in held:
            n += 1
        assert got[s].matched_blocks == n
    idx.compact()
    assert idx.num_entries("m") == sum(len(h) for h in model.values())
