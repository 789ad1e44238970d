"""The paged KV cache: fixed-size blocks, reference counts, a prefix-hash index and LRU eviction.

Modelled on vLLM's `BlockPool` so the events it queues are the ones vLLM
would send for the same history:

- Block 0 is the null block and is never handed out (vLLM and Megatron both
  reserve one), so `num_usable_blocks = num_blocks - 1`.
- Only FULL blocks carry a hash. A block keeps its hash after its last
  reference goes away, so a later request can hit it, until the pool needs
  the block again: then it is evicted and one BlockRemoved is queued for it
  alone, as vLLM does per physical block.
- Two requests that computed the same block in the same step hold two
  physical blocks with one hash and both are announced (vLLM does not
  de-duplicate); consumers count references per hash.
- Free blocks without a hash are reused first (LIFO); cached ones are evicted
  least-recently-used first. A freed request returns its blocks tail first so
  its prefix outlives its suffix: a later request can only hit a chain from
  its head.

Events carry full 32-byte digests; the codec projects them to the 64-bit
form on the wire when asked. Events are queued here and handed over by `take_events()`; the ZMQ publisher
lives in the shell. Must NOT do I/O, read clocks or import asyncio/zmq.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from llmgw.kv.hashing import BlockHash

__all__ = ["BlockPool"]

_MEDIUM = "GPU"
# vLLM (>= 0.20) numbers KV cache groups; a single-group model's events all carry 0.
_GROUP_IDX = 0


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """N blocks of B tokens; callers hold block ids, the pool holds everything else."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Stack of never-hashed free blocks (LIFO: no cache value to preserve).
        self._free_uncached: list[int] = list(range(num_blocks - 1, 0, -1))
        # Free blocks that still hold a hash, least recently used first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # hash -> the physical blocks holding it (several when requests raced to compute it).
        self._cached: dict[BlockHash, dict[int, _Block]] = {}
        self._events: list[KVEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Share of usable blocks referenced by requests (vLLM's kv_cache_usage_perc, 0..1)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest run of `hashes` (from the first) that the pool holds."""
        found: list[int] = []
        for block_hash in hashes:
            holders = self._cached.get(block_hash)
            if not holders:
                break
            found.append(next(iter(holders)))
        return found

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of these cached blocks sit in the free LRU (touching them uses up free blocks)."""
        return sum(1 for block_id in block_ids if self._blocks[block_id].ref_cnt == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks a request reuses."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free_cached[block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks with one reference each, evicting LRU cached ones; None if too few."""
        if count > self.num_free_blocks:
            return None
        out: list[int] = []
        for _ in range(count):
            if self._free_uncached:
                block_id = self._free_uncached.pop()
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                self._evict(self._blocks[block_id])
            self._blocks[block_id].ref_cnt = 1
            out.append(block_id)
        return out

    def _evict(self, block: _Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        holders = self._cached[block_hash]
        del holders[block.block_id]
        if not holders:
            del self._cached[block_hash]
        block.block_hash = None
        self._events.append(
            BlockRemoved(block_hashes=(block_hash,), medium=_MEDIUM, group_idx=_GROUP_IDX)
        )

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        *,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora_name: str | None,
        extra_keys: Sequence[Any] | None,
        lora_id: int | None = None,
    ) -> None:
        """Give newly full blocks their hashes and queue one BlockStored covering all of them."""
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            block = self._blocks[block_id]
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block_id] = block
        self._events.append(
            BlockStored(
                block_hashes=tuple(hashes),
                parent_block_hash=parent,
                token_ids=tuple(token_ids),
                block_size=self.block_size,
                lora_id=lora_id,
                lora_name=lora_name,
                medium=_MEDIUM,
                extra_keys=tuple(extra_keys) if extra_keys is not None else None,
                group_idx=_GROUP_IDX,
            )
        )

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, tail first (see the module docstring)."""
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_uncached.append(block_id)
                else:
                    self._free_cached[block_id] = None

    def clear(self) -> None:
        """Forget every hash (suspend); all blocks must already be unreferenced."""
        held = [b.block_id for b in self._blocks[1:] if b.ref_cnt]
        if held:
            raise RuntimeError(f"cannot clear the KV cache while blocks {held[:8]} are referenced")
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        self._free_cached.clear()
        self._free_uncached = list(range(self.num_blocks - 1, 0, -1))
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[BlockHash]:
        """One entry per physical block that holds a hash (duplicates included)."""
        return [h for h, holders in self._cached.items() for _ in holders]
