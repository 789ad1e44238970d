"""Our typed view of vLLM's KV-cache events (``vllm/distributed/kv_events.py``).

Holds frozen dataclasses mirroring vLLM's ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared`` and ``KVEventBatch``, field for field and in vLLM's declaration order (the
positional wire form depends on that order, as ``vllm/distributed/kv_events.py`` declares it).
A hash is either the 64-bit value events carry by default (int) or the full 32-byte digest
(bytes, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

This module must NOT encode, decode or do I/O: the wire lives in ``llmgw.kv.codec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVEvent",
]

# What an event carries for a block: uint64 (int mode, the default) or a 32-byte digest.
ExternalBlockHash: TypeAlias = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became full and cached in one engine step for one request."""

    block_hashes: tuple[ExternalBlockHash, ...]
    # Hash of the block just before the first one here; None when they start at token 0, and
    # always None for CPU-offload events (which carry hashes only).
    parent_block_hash: ExternalBlockHash | None
    # Tokens of all blocks in the event: len(block_hashes) * block_size, or empty for offload.
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None  # deprecated in vLLM; kept so positional arrays round-trip
    medium: str | None = None  # "GPU", "CPU", "STORAGE"; None means GPU (pre-0.10.2 engines)
    lora_name: str | None = None  # since 0.14
    extra_keys: tuple[object, ...] | None = None  # since 0.17, one entry per block
    group_idx: int | None = None  # since 0.20, KV cache group
    kv_cache_spec_kind: str | None = None  # since 0.22
    kv_cache_spec_sliding_window: int | None = None  # since 0.22
    locality: str | None = None  # since 0.26: "LOCAL" or "REMOTE"
    ownership: str | None = None  # since 0.29
    session_id: str | None = None  # since 0.30
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None  # since 0.33


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from ``medium``: one per physical block, duplicates included."""

    block_hashes: tuple[ExternalBlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One engine step's events, as one ZMQ message payload."""

    ts: float
    events: tuple[KVEvent, ...]
    # The publisher's DP rank; None only for vLLM 0.9.0, whose batch has two elements.
    data_parallel_rank: int | None = 0
