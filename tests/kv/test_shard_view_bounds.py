"""Finding 7 (hardening-3): a node's credential grew every control plane's KV index without
bound (24 deltas of 131,072 new hashes for its own idle shard: RSS 246 -> 542 MB, 60-85 ms of
loop each). A shard's view is bounded by its engine's capacity (or a ceiling when unknown),
and one request by the protocol's message cap."""

from __future__ import annotations

import random
import time
from array import array

import pytest
from structlog.testing import capture_logs

from llmgw.engines.kv_capacity import SIM_DEFAULT_BLOCKS, kv_capacity_blocks
from llmgw.kv.shard_views import CAPACITY_SLACK, PlacedShard, ShardViews
from llmgw.protocol.kvstream import (
    MAX_BLOCKS_PER_MESSAGE,
    KvDeltaRequest,
    KvStreamError,
    decode_kv_request,
    encode_kv_request,
)

RNG = random.Random(7)


def _hashes(n: int) -> array[int]:
    return array("Q", (RNG.getrandbits(64) for _ in range(n)))


def _placed(max_blocks: int | None) -> dict[str, PlacedShard]:
    return {"s": PlacedShard("node", "m", 16, max_blocks=max_blocks)}


def _reset(n: int, version: int = 1) -> KvDeltaRequest:
    return KvDeltaRequest("s", 0, version, reset=True, added={"GPU": _hashes(n)})


def _delta(base: int, n: int) -> KvDeltaRequest:
    return KvDeltaRequest("s", base, base + 1, added={"GPU": _hashes(n)})


@pytest.mark.parametrize(
    ("profile", "want"),
    [
        ({"engine": "sim", "args": []}, SIM_DEFAULT_BLOCKS),
        ({"engine": "sim", "args": ["--num-blocks", "900"]}, 900),
        ({"engine": "vllm", "args": ["--num-gpu-blocks-override=5000"]}, 5000),
        # Read as the engine's parser reads it: vLLM's underscore spelling too.
        ({"engine": "vllm", "args": ["--num_gpu_blocks_override", "70"]}, 70),
        ({"engine": "vllm", "args": ["--max-num-seqs", "8"]}, None),  # sized from GPU memory
        ({"engine": "sglang", "args": ["--max-total-tokens", "1000"], "kv_hash": {"block_size": 16}}, 63),
        ({"engine": "llamacpp"}, None),
    ],
)  # fmt: skip
def test_the_engines_capacity_is_read_from_its_profile(profile: dict, want: int | None) -> None:  # type: ignore[type-arg]
    assert kv_capacity_blocks(profile) == want


def test_a_delta_past_the_engines_capacity_is_refused_and_the_view_marked() -> None:
    views = ShardViews()
    placed = _placed(1000)  # bound: 2000 blocks
    assert views.bound(placed["s"]) == int(1000 * CAPACITY_SLACK)
    assert views.apply("node", _reset(1500), placed) == "ack"
    with capture_logs() as logs:
        assert views.apply("node", _delta(1, 600), placed) == "need_full"
        # The next one finds its base forgotten: the agent must send a full copy.
        assert views.apply("node", _delta(2, 10), placed) == "need_full"
        # A full copy past the bound is not applied either: empty, partial, retry later.
        assert views.apply("node", _reset(2500, 5), placed) == "retry"
    assert views.index.num_blocks("s") == 0
    assert views.index.is_partial("s")
    assert views.counts["over_capacity"] == 2
    warnings = [e for e in logs if e["event"] == "kv_view_over_capacity"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    # A copy within the bound restores a whole view.
    assert views.apply("node", _reset(1800, 6), placed) == "ack"
    assert views.index.num_blocks("s") == 1800 and not views.index.is_partial("s")
    assert views.apply("node", _delta(6, 100), placed) == "ack"


def test_a_shard_of_unknown_capacity_stops_at_the_ceiling() -> None:
    """The finding's shape: delta after delta of new hashes for one idle shard."""
    views = ShardViews(max_view_blocks=50_000)
    placed = _placed(None)
    assert views.apply("node", _reset(0), placed) == "ack"
    version, answers = 1, []
    for _ in range(8):
        answer = views.apply("node", _delta(version, MAX_BLOCKS_PER_MESSAGE), placed)
        answers.append(answer)
        if answer == "ack":
            version += 1
    assert views.index.num_blocks("s") <= 50_000
    assert answers[:3] == ["ack"] * 3 and "need_full" in answers


def test_one_request_is_capped_so_it_holds_the_loop_briefly() -> None:
    too_big = KvDeltaRequest(
        "s", 0, 1, reset=True, added={"GPU": _hashes(MAX_BLOCKS_PER_MESSAGE + 1)}
    )
    with pytest.raises(KvStreamError):
        encode_kv_request(too_big)
    # Measured ~1-6 ms per 10k hashes into a growing index: the cap keeps a request near 10 ms.
    assert MAX_BLOCKS_PER_MESSAGE <= 16_384
    views = ShardViews()
    placed = _placed(None)
    views.apply("node", _reset(100_000), placed)
    best = float("inf")
    for i in range(3):
        body = encode_kv_request(_delta(1 + i, MAX_BLOCKS_PER_MESSAGE))
        started = time.perf_counter()
        assert views.apply("node", decode_kv_request(body), placed) == "ack"
        best = min(best, time.perf_counter() - started)
    assert best < 0.05, best  # generous: a shared CI core; ~3-10 ms on an idle one
