"""KV media (issue 35): blocks vLLM offloads to host memory or storage are kept apart from the
device's in the index and score no hit; a medium llmgw does not know is counted and dropped,
never fatal. Driven as the agent and the router drive it: vLLM's wire payload decoded, applied
to the mirror, its change applied to the index, the prompt scored by the router."""

from __future__ import annotations

from llmgw.gateway.routing.router import Candidate, HashParams, precise_shares
from llmgw.kv import (
    DEVICE_MEDIUM,
    KNOWN_MEDIA,
    BlockMirror,
    BlockRemoved,
    BlockStored,
    EventBatch,
    PrefixIndex,
    block_hashes,
    decode_batch,
    encode_batch,
    hash64,
)

P = HashParams(seed="4242", block_size=4, extra_key_format="tagged")
PROMPT = list(range(1, 18))  # 17 tokens: 4 scorable blocks of 4
HASHES = [hash64(d) for d in block_hashes(PROMPT, 4, seed=P.seed, extra_key_format="tagged")]
GPU, CPU = Candidate("r-gpu", "s-gpu", 0), Candidate("r-cpu", "s-cpu", 0)


def _through_the_wire(*events: BlockStored | BlockRemoved) -> EventBatch:
    """The events as vLLM's publisher sends them (map encoding), decoded as the agent does."""
    return decode_batch(encode_batch(EventBatch(1.0, events))).batch


def _stored(medium: str, block_size: int = 4) -> BlockStored:
    # An offload event carries hashes only (no parent, no tokens, block size 0).
    tokens = tuple(PROMPT[:16]) if block_size else ()
    return BlockStored(tuple(HASHES), None, tokens, block_size, medium=medium)


def _index(**mirrors: BlockMirror) -> PrefixIndex:
    index = PrefixIndex()
    for shard, mirror in mirrors.items():
        index.apply_change("m", shard.replace("_", "-"), mirror.changes_since(0))
    return index


def test_a_prompt_held_only_in_host_memory_scores_no_device_hit() -> None:
    on_gpu, offloaded = BlockMirror(), BlockMirror()
    on_gpu.apply(0, _through_the_wire(_stored("GPU")))
    # The same blocks, but only where vLLM's CPU offloading put them.
    offloaded.apply(0, _through_the_wire(_stored("CPU", block_size=0)))
    index = _index(s_gpu=on_gpu, s_cpu=offloaded)
    # Kept apart, not lost: the index holds them under their own medium.
    assert index.blocks("s-cpu") == {"CPU": sorted(HASHES)}
    assert index.score("m", HASHES, ["s-cpu"], media=[DEVICE_MEDIUM])["s-cpu"].matched_blocks == 0
    shares = precise_shares(
        index, "m", PROMPT, {P: [GPU, CPU]}, complete=lambda s: True, cache_salt=None
    )
    assert shares == {"r-gpu": 1.0, "r-cpu": 0.0}


def test_an_unknown_medium_is_counted_and_dropped_not_fatal() -> None:
    mirror = BlockMirror()
    weird = BlockStored(tuple(HASHES[:2]), None, (), 0, medium="NVME_X")
    removed = BlockRemoved((HASHES[0],), medium="nvme_x")
    result = mirror.apply(0, _through_the_wire(weird, _stored("GPU"), removed))
    # The rest of the batch applies; the unknown tier's hashes are counted, not held.
    assert result.outcome == "applied"
    assert mirror.num_unknown_medium_blocks == 3
    assert mirror.last_unknown_medium == "NVME_X"
    assert mirror.num_unknown_removals == 0
    assert _index(s_gpu=mirror).blocks("s-gpu") == {"GPU": sorted(HASHES)}
    # Known media, in any case vLLM's connectors spell them, are not counted.
    mirror.apply(1, _through_the_wire(_stored("cpu", 0), _stored("STORAGE", 0)))
    assert mirror.num_unknown_medium_blocks == 3
    assert {"GPU", "CPU", "STORAGE"} == KNOWN_MEDIA
