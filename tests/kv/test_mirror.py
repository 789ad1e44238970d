"""The agent's block mirror: sequence handling, reference counts, deltas vs snapshots."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kv import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from llmgw.kv.mirror import BlockMirror, MirrorDelta, MirrorSnapshot


def stored(*hashes: int, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 0, medium=medium)


def batch(*events: object) -> EventBatch:
    return EventBatch(0.0, tuple(events))  # type: ignore[arg-type]


def as_sets(blocks: object) -> set[tuple[str, int]]:
    return {(m, h) for m, hs in blocks.items() for h in hs}  # type: ignore[attr-defined]


def test_refcounts_keep_duplicate_blocks_until_last_removal() -> None:
    m = BlockMirror()
    assert m.apply(0, batch(stored(1, 2), stored(1))).outcome == "applied"
    m.apply(1, batch(BlockRemoved((1,), "GPU")))
    assert m.contains(1) and m.refcount(1) == 1  # a second physical block still holds hash 1
    m.apply(2, batch(BlockRemoved((1,), "gpu")))  # lowercase medium folds onto GPU
    assert not m.contains(1) and m.contains(2)


def test_medium_keys_are_separate_and_none_means_gpu() -> None:
    m = BlockMirror()
    m.apply(0, batch(stored(5, medium=None), stored(5, medium="CPU")))
    m.apply(1, batch(BlockRemoved((5,), None)))
    assert not m.contains(5, "GPU") and m.contains(5, "cpu")


def test_set_mode_is_idempotent_for_re_emitted_stores() -> None:
    m = BlockMirror(store_mode="set")
    m.apply(0, batch(stored(1), stored(1)))
    m.apply(1, batch(BlockRemoved((1,), "GPU")))
    assert not m.contains(1)


def test_gap_duplicate_and_resync() -> None:
    m = BlockMirror()
    m.apply(0, batch(stored(1)))
    v = m.version
    gap = m.apply(3, batch(stored(9)))
    assert (gap.outcome, gap.missing_from, gap.missing_to) == ("gap", 1, 2)
    assert not m.contains(9) and m.version == v
    assert m.apply(0, batch(stored(7))).outcome == "duplicate" and not m.contains(7)
    m.resync(3, batch(stored(9)))
    assert m.partial and m.contains(9) and not m.contains(1)
    snap = m.changes_since(v)
    assert isinstance(snap, MirrorSnapshot) and snap.reason == "gap" and snap.partial
    assert m.expected_seq == 4


def test_clear_and_restart_reset_and_complete_the_view() -> None:
    m = BlockMirror()
    m.resync(5, batch(stored(1)))
    assert m.partial
    v = m.version
    m.apply(6, batch(AllBlocksCleared(), stored(2)))
    snap = m.changes_since(v)
    assert isinstance(snap, MirrorSnapshot) and snap.reason == "cleared" and not snap.partial
    assert as_sets(snap.blocks) == {("GPU", 2)}
    v = m.version
    m.engine_started()
    assert m.expected_seq == 0 and m.num_blocks == 0
    snap = m.changes_since(v)
    assert isinstance(snap, MirrorSnapshot) and snap.reason == "engine_restart"


def test_capacity_drops_new_stores_and_marks_partial() -> None:
    m = BlockMirror(max_blocks=2)
    m.apply(0, batch(stored(1, 2, 3)))
    assert m.num_blocks == 2 and m.num_dropped_stores == 1 and m.partial
    assert m.snapshot().partial


def test_journal_trim_falls_back_to_snapshot() -> None:
    m = BlockMirror(max_journal=8)
    for seq in range(20):
        m.apply(seq, batch(stored(100 + seq)))
    assert isinstance(m.changes_since(1), MirrorSnapshot)
    assert m.changes_since(1).reason == "base_unknown"  # type: ignore[union-attr]
    recent = m.changes_since(m.version - 2)
    assert isinstance(recent, MirrorDelta) and set(recent.added["GPU"]) == {118, 119}


def test_dump_and_load_round_trip() -> None:
    m = BlockMirror()
    m.apply(0, batch(stored(1, 1, 2), stored(3, medium="CPU")))
    again = BlockMirror.load(m.dump())
    assert as_sets(again.snapshot().blocks) == as_sets(m.snapshot().blocks)
    assert again.refcount(1) == 2 and again.expected_seq == 1
    assert isinstance(again.changes_since(m.version), MirrorSnapshot)


_hash = st.integers(0, 6)
_medium = st.sampled_from(["GPU", "CPU", None, "cpu"])
_event = st.one_of(
    st.builds(lambda hs, md: stored(*hs, medium=md), st.lists(_hash, max_size=4), _medium),
    st.builds(lambda hs, md: BlockRemoved(tuple(hs), md), st.lists(_hash, max_size=4), _medium),
    st.just(AllBlocksCleared()),
)
# A step is a batch to apply in order, a batch that arrives after a lost one (resync), a
# delta taken by a receiver, or an engine restart.
_step = st.one_of(
    st.tuples(st.just("batch"), st.lists(_event, max_size=4)),
    st.tuples(st.just("lost"), st.lists(_event, max_size=3)),
    st.tuples(st.just("sync"), st.none()),
    st.tuples(st.just("restart"), st.none()),
)


@settings(deadline=None, max_examples=300)
@given(steps=st.lists(_step, max_size=30), max_journal=st.sampled_from([3, 1000]))
def test_deltas_replay_to_the_snapshot(steps: list[tuple[str, object]], max_journal: int) -> None:
    m = BlockMirror(max_journal=max_journal)
    model: Counter[tuple[str, int]] = Counter()
    receiver: set[tuple[str, int]] = set()
    base = m.version
    reset_since_base = False
    seq = 0
    for kind, payload in steps:
        if kind in ("batch", "lost"):
            events = payload
            if kind == "lost":
                seq += 1  # the batch before this one never arrives
                assert m.apply(seq, batch(*events)).outcome == "gap"  # type: ignore[arg-type]
                m.resync(seq, batch(*events))  # type: ignore[arg-type]
                model.clear()
                reset_since_base = True
            else:
                assert m.apply(seq, batch(*events)).outcome == "applied"  # type: ignore[arg-type]
            seq += 1
            for ev in events:  # type: ignore[attr-defined]
                if isinstance(ev, AllBlocksCleared):
                    model.clear()
                    reset_since_base = True
                    continue
                medium = (ev.medium or "GPU").upper()
                for h in ev.block_hashes:
                    if isinstance(ev, BlockStored):
                        model[(medium, h)] += 1
                    elif model[(medium, h)] > 0:
                        model[(medium, h)] -= 1
        elif kind == "restart":
            m.engine_started()
            model.clear()
            seq = 0
            reset_since_base = True
        else:
            change = m.changes_since(base)
            if reset_since_base:
                assert isinstance(change, MirrorSnapshot)
                assert change.reason in ("cleared", "gap", "engine_restart")
            if isinstance(change, MirrorSnapshot):
                receiver = as_sets(change.blocks)
            else:
                added, removed = as_sets(change.added), as_sets(change.removed)
                assert not added & removed
                assert not added & receiver and removed <= receiver
                receiver = (receiver - removed) | added
            base = change.version
            reset_since_base = False
            assert receiver == as_sets(m.snapshot().blocks)
        present = {k for k, n in model.items() if n > 0}
        assert as_sets(m.snapshot().blocks) == present


def test_wire_to_mirror_with_a_gap_filled_by_replay() -> None:
    from llmgw.kv import (
        decode_batch,
        decode_message,
        decode_replay_reply,
        encode_batch,
        encode_message,
        encode_replay_end,
        encode_replay_reply,
    )

    published = [
        encode_batch(EventBatch(float(seq), (stored(10 + seq),)), shape=shape)  # type: ignore[arg-type]
        for seq, shape in enumerate(["map", "array", "map", "map"])
    ]
    m = BlockMirror()
    for seq in (0, 2):  # batch 1 is lost on the PUB socket
        msg = decode_message(encode_message("kv@s1", seq, published[seq]))
        result = m.apply(msg.seq, decode_batch(msg.payload).batch)
    assert (result.outcome, result.missing_from) == ("gap", 1)
    for topic in (None, "kv@s1"):  # replay reply shapes of vLLM <= 0.25 and >= 0.26
        replies = [encode_replay_reply(s, published[s], topic=topic) for s in (1, 2)]
        for frames in [*replies, encode_replay_end(with_topic=topic is not None)]:
            reply = decode_replay_reply(frames)
            if reply.is_end:
                break
            m.apply(reply.seq, decode_batch(reply.payload).batch)
    assert m.apply(3, decode_batch(published[3]).batch).outcome == "applied"
    assert as_sets(m.snapshot().blocks) == {("GPU", h) for h in (10, 11, 12, 13)}
    assert not m.partial and m.num_duplicates == 2
