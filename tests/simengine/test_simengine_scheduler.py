"""The pure scheduler and block pool: admission, prefix reuse, LRU eviction, pausing, events."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.errors import ConflictError, SpecError
from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from llmgw.kv.hashing import BlockHash, block_hashes, hash_block, none_hash
from llmgw.simengine.scheduler import RequestSpec, Scheduler, SchedulerConfig, StepResult

ROOT = none_hash("7")


def _hasher(parent: BlockHash | None, tokens: tuple[int, ...], index: int) -> BlockHash:
    return hash_block(ROOT if parent is None else parent, tokens, None)


def _spec(rid: str, prompt: list[int] | range, num_out: int, base: int = 50_000) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        output_token_ids=tuple(range(base, base + num_out)),
        hasher=_hasher,
    )


def _run(s: Scheduler, max_steps: int = 10_000) -> list[StepResult]:
    results: list[StepResult] = []
    for _ in range(max_steps):
        if not s.has_work():
            return results
        results.append(s.step())
    raise AssertionError("scheduler did not drain: a request is stuck")


class _Mirror:
    """What a KV-event subscriber holds: references per hash."""

    def __init__(self) -> None:
        self.refs: Counter[int | bytes] = Counter()

    def apply(self, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.refs[h] += 1
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.refs[h] -= 1
                    assert self.refs[h] >= 0, "removal of a block that was never stored"
                    if not self.refs[h]:
                        del self.refs[h]
            elif isinstance(event, AllBlocksCleared):
                self.refs.clear()


def test_second_request_reuses_prefix_capped_below_prompt_length() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64))
    s.add_request(_spec("a", range(1, 13), 2))  # 12 tokens: 3 full blocks
    _run(s)
    s.add_request(_spec("b", range(1, 13), 2))
    first = s.step()
    # A hit is capped at num_tokens - 1: the third block would cover the last token, so 8.
    assert first.admitted == (("b", 8),)
    assert first.prefix_hits == 8 and first.prefix_queries == 12
    assert first.num_prefill_tokens == 4


def test_prefix_hashes_match_llmgw_kv_block_hashes() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4))
    prompt = list(range(100, 114))
    s.add_request(_spec("a", prompt, 1))
    s.step()
    stored = [e for e in s.take_events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == block_hashes(prompt, 4, seed="7")
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == tuple(prompt[:12])


def test_decode_tokens_that_fill_a_block_are_stored_with_their_parent() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4))
    s.add_request(_spec("a", range(1, 7), 8, base=900))  # 6 prompt + 8 output
    events: list[KVEvent] = []
    for result in _run(s):
        assert result is not None
        events.extend(s.take_events())
    stored = [e for e in events if isinstance(e, BlockStored)]
    all_tokens = [*range(1, 7), *range(900, 908)]
    # The last output token is never computed: 13 computed tokens -> 3 full blocks, each stored.
    assert [len(e.block_hashes) for e in stored] == [1, 1, 1]
    assert [h for e in stored for h in e.block_hashes] == block_hashes(all_tokens[:12], 4, seed="7")
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]


def test_lru_eviction_removes_least_recently_used_blocks_one_event_each() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_num_batched_tokens=64))
    mirror = _Mirror()
    s.add_request(_spec("old", range(1, 17), 1))  # 4 blocks
    _run(s)
    s.add_request(_spec("new", range(101, 117), 1))  # 4 more: the cache (8 usable) is full
    _run(s)
    mirror.apply(s.take_events())
    # "again" hits 3 blocks of "new" (making them most recently used) and needs 1 fresh block.
    s.add_request(_spec("again", range(101, 117), 1))
    _run(s)
    s.add_request(_spec("third", range(201, 209), 1))  # needs 2 blocks
    _run(s)
    events = s.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [len(e.block_hashes) for e in removed] == [1, 1, 1]
    old_hashes = block_hashes(list(range(1, 17)), 4, seed="7")
    # All three evictions hit "old", the least recently used chain, tail first (a request frees
    # its blocks tail first, so a chain keeps its head: the only part a later prompt can hit).
    assert [e.block_hashes[0] for e in removed] == old_hashes[:0:-1]
    mirror.apply(events)
    assert mirror.refs == Counter(s.cached_block_hashes())
    s.add_request(_spec("probe-new", range(101, 117), 1))
    assert s.step().admitted == (("probe-new", 12),)


def test_decode_pauses_when_blocks_run_out_and_everyone_finishes() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_num_batched_tokens=64))
    for i in range(3):
        s.add_request(_spec(f"r{i}", range(1000 * i + 1, 1000 * i + 6), 20, base=40_000 + 100 * i))
    results = _run(s)
    emitted = Counter(r for result in results for r in result.emitted)
    assert emitted == {"r0": 20, "r1": 20, "r2": 20}
    assert s.num_pauses_total > 0
    assert s.pool.num_free_blocks == 8


def test_nothing_is_admitted_while_a_request_is_paused() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=5, block_size=4, max_num_batched_tokens=64))
    s.add_request(_spec("a", range(1, 8), 9))  # 2 blocks, grows into the last free one first
    s.add_request(_spec("b", range(11, 14), 6))  # 1 block, needs a 2nd at its 5th token: paused
    s.add_request(_spec("c", range(21, 29), 2))  # 2 blocks: waits behind the paused one
    steps_paused_with_waiting = 0
    while s.has_work():
        result = s.step()
        if s.num_paused:
            # A new request would take the block the paused one waits for.
            assert not result.admitted
            steps_paused_with_waiting += bool(s.num_waiting)
    assert steps_paused_with_waiting > 0


def test_chunked_prefill_respects_budget_and_keeps_one_chunked_request() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=128, block_size=4, max_num_batched_tokens=10))
    s.add_request(_spec("long", range(1, 30), 2))
    s.add_request(_spec("long2", range(101, 130), 2))
    steps = []
    while s.has_work():
        result = s.step()
        steps.append(result)
        assert result.num_prefill_tokens + result.num_decode_seqs <= 10
    first_tokens = [i for i, r in enumerate(steps) if "long" in r.emitted]
    assert first_tokens[0] >= 2  # 29 tokens at 10 per step take three steps
    # Never leave exactly one prompt token for a later chunk (Megatron's rule).
    assert all(r.num_prefill_tokens != 1 or r.num_decode_seqs for r in steps[:3])


def test_request_that_can_never_fit_is_refused_with_sizes_in_the_message() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=5, block_size=4, max_model_len=1000))
    with pytest.raises(SpecError, match=r"needs 5 KV blocks .* only 4 usable blocks"):
        s.add_request(_spec("big", range(1, 18), 4))
    with pytest.raises(SpecError, match="max_model_len is 1000"):
        s.add_request(_spec("long", range(1, 999), 4))
    s.add_request(_spec("ok", range(1, 5), 2))
    with pytest.raises(ConflictError):
        s.add_request(_spec("ok", range(1, 5), 2))


def test_max_num_seqs_caps_requests_holding_kv() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=256, block_size=4, max_num_seqs=2))
    for i in range(5):
        s.add_request(_spec(f"r{i}", range(10 * i + 1, 10 * i + 5), 3))
    for _ in range(20):
        s.step()
        assert s.num_running + s.num_paused <= 2
        if not s.has_work():
            break


def test_abort_frees_blocks_and_keeps_computed_prefix_cached() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4))
    s.add_request(_spec("a", range(1, 14), 50))
    s.step()
    s.step()
    assert s.pool.num_free_blocks < 31
    assert s.abort("a")
    assert not s.abort("a")
    assert s.pool.num_free_blocks == 31
    assert not s.has_work()
    s.add_request(_spec("b", range(1, 14), 1))
    assert s.step().admitted == (("b", 12),)


def test_suspend_clears_cache_and_requeues_active_requests() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4))
    s.add_request(_spec("a", range(1, 14), 10))
    s.add_request(_spec("b", range(21, 34), 10))
    s.step()
    s.step()
    s.take_events()
    s.suspend()
    assert s.take_events() == [AllBlocksCleared()]
    assert s.cached_block_hashes() == [] and s.num_waiting == 2 and s.num_running == 0
    results = _run(s)
    assert Counter(r for result in results for r in result.emitted) == {"a": 8, "b": 8}


@st.composite
def _workloads(draw: st.DrawFn) -> list[tuple[str, int, int, int]]:
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["add", "add", "add", "step", "step", "abort", "suspend"]))
        ops.append(
            (kind, draw(st.integers(0, 5)), draw(st.integers(1, 30)), draw(st.integers(1, 12)))
        )
    return ops


@settings(deadline=None, max_examples=80)
@given(_workloads(), st.integers(3, 24), st.integers(1, 6))
def test_events_always_describe_the_cache_exactly(
    ops: list[tuple[str, int, int, int]], num_blocks: int, block_size: int
) -> None:
    s = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=4
        )
    )
    mirror = _Mirror()
    active: list[str] = []
    for n, (kind, family, length, outputs) in enumerate(ops):
        if kind == "add":
            rid = f"r{n}"
            try:
                # Families share prefixes, so hits, duplicates and evictions all happen.
                s.add_request(_spec(rid, [family * 1000 + t for t in range(length)], outputs))
                active.append(rid)
            except SpecError:
                pass
        elif kind == "step" and s.has_work():
            s.step()
        elif kind == "abort" and active:
            s.abort(active.pop(family % len(active)))
        elif kind == "suspend":
            s.suspend()
        mirror.apply(s.take_events())
        assert mirror.refs == Counter(s.cached_block_hashes())
        assert s.pool.num_free_blocks <= num_blocks - 1
    _run(s)
    mirror.apply(s.take_events())
    assert mirror.refs == Counter(s.cached_block_hashes())
    assert s.pool.num_free_blocks == num_blocks - 1


def test_a_one_token_step_budget_is_refused() -> None:
    # A chunk never leaves exactly one prompt token, so a budget of one could never start a
    # prompt of two or more tokens: the engine would spin forever instead of failing at start.
    with pytest.raises(SpecError, match="max_num_batched_tokens=1 must be >= 2"):
        SchedulerConfig(max_num_batched_tokens=1)
    assert SchedulerConfig(max_num_batched_tokens=2).max_num_batched_tokens == 2
