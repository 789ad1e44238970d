"""The agent's mirror of one engine's KV cache, fed by that engine's event batches.

Holds ``BlockMirror``: it applies ``EventBatch``es in sequence order, refuses to skip a sequence
gap (the caller replays or resyncs), counts references per (hash, medium), and answers "what
changed since version v" as net added/removed hashes per medium, or as a full snapshot when the
receiver's base is unknown or a reset (cache cleared, engine restart, unfillable gap) intervened.
Every snapshot says why it is one; a view that may lack blocks is marked ``partial``.

Media: a block is held per tier ("GPU", and vLLM's offload tiers "CPU" and "STORAGE"), each kept
apart to the router, which scores device hits only (``DEVICE_MEDIUM``). Events on a medium
llmgw does not know are counted (``num_unknown_medium_blocks``) and dropped, never fatal: no
scorer reads a tier it does not know, and a name chosen by an engine need not fit the relay's
wire, where one over-long name would have the control plane refuse the shard's every delta.

Reference counts (docs/architecture.md §7, "honest views"): vLLM does not de-duplicate blocks and reports one
BlockRemoved per physical block, so a store adds one reference and a removal takes one away; the
hash is present while its count is above zero. Counting is what keeps a hash held by two physical
blocks from vanishing when the first is evicted. Re-emitted stores (vLLM >= 0.26 with
``kv_cache_report_mode="full"``) would make counts only grow and pin evicted blocks: llmgw runs
engines without re-reporting, and ``store_mode="set"`` exists for engines that cannot (a store
then sets presence, any removal clears it: a duplicate block's eviction may then hide a block the
engine still holds, a miss rather than a false hit).

This module must NOT do I/O, know about sockets or persist anything itself: the node agent's
listener feeds it and stores ``dump()`` bytes where it likes.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgpack

from llmgw.kv.errors import KVError
from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = [
    "DEVICE_MEDIUM",
    "KNOWN_MEDIA",
    "ApplyResult",
    "BlockMirror",
    "MirrorDelta",
    "MirrorSnapshot",
    "ResetReason",
    "StoreMode",
    "normalize_medium",
]

StoreMode = Literal["count", "set"]
# Why a receiver must replace what it holds for this engine instead of applying a delta.
ResetReason = Literal[
    "cleared",  # AllBlocksCleared: the engine dropped its cache (view complete: empty)
    "engine_restart",  # the supervisor started the engine (view complete: empty)
    "gap",  # batches lost and not replayable (view partial)
    "base_unknown",  # the receiver's base version is outside the journal (view unchanged)
    "requested",  # the caller asked for a full copy
]

_MASK64 = (1 << 64) - 1

# The tier the engine computes from: what a prefix hit means. vLLM's CPU build says "GPU" too
# (its block pool's medium is fixed), so a CPU replica's own cache counts as a device hit.
DEVICE_MEDIUM = "GPU"
# vLLM's media (vllm/distributed/kv_events.py MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE), folded.
KNOWN_MEDIA: frozenset[str] = frozenset({DEVICE_MEDIUM, "CPU", "STORAGE"})


def normalize_medium(medium: str | None) -> str:
    """vLLM's tier name, upper-cased; a missing medium means GPU (engines before 0.10.2).

    One vLLM connector sends lowercase "cpu": without folding, a removal in "cpu" would never
    cancel a store in "CPU" and the block would look cached forever.
    """
    return "GPU" if medium is None else medium.upper()


def _as_uint64(value: int | bytes) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & _MASK64


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What ``apply`` did with one batch.

    ``gap``: nothing applied; batches ``missing_from..missing_to`` must be replayed first (or the
    caller gives up and calls ``resync``).
    """

    outcome: Literal["applied", "duplicate", "gap"]
    version: int
    missing_from: int | None = None
    missing_to: int | None = None


@dataclass(frozen=True, slots=True)
class MirrorDelta:
    """Net changes between ``base_version`` and ``version``, per medium (uint64 hashes)."""

    base_version: int
    version: int
    added: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    removed: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    partial: bool = False

    @property
    def is_empty(self) -> bool:
        return not any(self.added.values()) and not any(self.removed.values())


@dataclass(frozen=True, slots=True)
class MirrorSnapshot:
    """Everything the engine holds at ``version``, replacing what the receiver had."""

    version: int
    blocks: Mapping[str, tuple[int, ...]]
    reason: ResetReason
    partial: bool = False


class BlockMirror:
    """One engine's cached blocks, as reference counts per (hash64, medium)."""

    def __init__(
        self,
        *,
        max_blocks: int = 2_000_000,
        max_journal: int = 1_000_000,
        store_mode: StoreMode = "count",
    ) -> None:
        if store_mode not in ("count", "set"):
            raise KVError(f"store_mode {store_mode!r} is unknown; use 'count' or 'set'")
        if max_blocks < 1 or max_journal < 1:
            raise KVError("max_blocks and max_journal must be positive", field="max_blocks")
        # Distinct (hash, medium) pairs tracked at most; beyond it new stores are dropped and the
        # view turns partial (the one honest answer when memory, not the engine, is the limit).
        self.max_blocks = max_blocks
        self.max_journal = max_journal
        self.store_mode: StoreMode = store_mode
        self._refs: dict[str, dict[int, int]] = {}
        self._num_blocks = 0
        # Presence transitions since the last reset: parallel arrays (version, hash, flag), flag =
        # medium index * 2 + (1 if added else 0). Arrays, not tuples: ~17 bytes per transition.
        self._media: list[str] = []
        self._j_version = array("Q")
        self._j_hash = array("Q")
        self._j_flag = array("H")
        self.version = 0
        self._floor = 0  # oldest base version the journal still covers
        self._reset_version = 0  # the version the last reset produced
        self.last_reset: ResetReason = "engine_restart"
        self.partial = False
        self.last_seq: int | None = None
        self.num_duplicates = 0
        self.num_unknown_removals = 0
        self.num_dropped_stores = 0
        self.num_skipped_batches = 0
        # Block hashes in events on a medium outside KNOWN_MEDIA, dropped; the last such medium.
        self.num_unknown_medium_blocks = 0
        self.last_unknown_medium = ""

    # --- feeding ------------------------------------------------------------------------------

    @property
    def expected_seq(self) -> int:
        """The sequence number the next live batch must carry (0 after an engine start)."""
        return 0 if self.last_seq is None else self.last_seq + 1

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def apply(self, seq: int, batch: EventBatch) -> ApplyResult:
        """Apply the batch numbered ``seq`` if it is the next one; report a gap otherwise.

        A seq at or below the last applied one is a duplicate (a replay overlapping live
        traffic) and is dropped. Restarts are not inferred from seq going backwards: the
        supervisor sees every engine start and calls ``engine_started`` (docs/architecture.md §7).
        """
        expected = self.expected_seq
        if seq < expected:
            self.num_duplicates += 1
            return ApplyResult("duplicate", self.version)
        if seq > expected:
            return ApplyResult("gap", self.version, missing_from=expected, missing_to=seq - 1)
        self._apply_events(batch)
        self.last_seq = seq
        return ApplyResult("applied", self.version)

    def resync(self, seq: int, batch: EventBatch) -> ApplyResult:
        """Give up on a gap that replay cannot fill: reset to a partial view, then apply ``batch``.

        What the engine stored in the lost batches is unknown, so the view may lack blocks until
        the engine clears its cache or restarts.
        """
        self.num_skipped_batches += max(0, seq - self.expected_seq)
        self._reset("gap", partial=True)
        self._apply_events(batch)
        self.last_seq = seq
        return ApplyResult("applied", self.version)

    def engine_started(self) -> None:
        """The supervisor (re)started the engine: its cache and its seq counter start empty."""
        self._reset("engine_restart", partial=False)
        self.last_seq = None

    def _reset(self, reason: ResetReason, *, partial: bool) -> None:
        self._refs = {}
        self._num_blocks = 0
        self._j_version = array("Q")
        self._j_hash = array("Q")
        self._j_flag = array("H")
        self.version += 1
        self._floor = self._reset_version = self.version
        self.last_reset = reason
        self.partial = partial

    def _medium_code(self, medium: str) -> int:
        try:
            return self._media.index(medium)
        except ValueError:
            self._media.append(medium)
            return len(self._media) - 1

    def _apply_events(self, batch: EventBatch) -> None:
        version = self.version + 1
        changed = False
        was_partial = self.partial
        jv, jh, jf = self._j_version, self._j_hash, self._j_flag
        for event in batch.events:
            if isinstance(event, BlockStored):
                medium = normalize_medium(event.medium)
                if medium not in KNOWN_MEDIA:
                    self._unknown_medium(medium, len(event.block_hashes))
                    continue
                refs = self._refs.get(medium)
                if refs is None:
                    refs = self._refs[medium] = {}
                code = self._medium_code(medium) * 2
                counting = self.store_mode == "count"
                for raw in event.block_hashes:
                    h = _as_uint64(raw)
                    count = refs.get(h, 0)
                    if count:
                        if counting:
                            refs[h] = count + 1
                        continue
                    if self._num_blocks >= self.max_blocks:
                        self.num_dropped_stores += 1
                        self.partial = True
                        continue
                    refs[h] = 1
                    self._num_blocks += 1
                    jv.append(version)
                    jh.append(h)
                    jf.append(code | 1)
                    changed = True
            elif isinstance(event, BlockRemoved):
                medium = normalize_medium(event.medium)
                if medium not in KNOWN_MEDIA:
                    self._unknown_medium(medium, len(event.block_hashes))
                    continue
                refs = self._refs.get(medium)
                if refs is None:
                    self.num_unknown_removals += len(event.block_hashes)
                    continue
                code = self._medium_code(medium) * 2
                for raw in event.block_hashes:
                    h = _as_uint64(raw)
                    count = refs.get(h, 0)
                    if not count:
                        # A block stored before a gap, or dropped at capacity: nothing to undo.
                        self.num_unknown_removals += 1
                        continue
                    if count > 1 and self.store_mode == "count":
                        refs[h] = count - 1
                        continue
                    del refs[h]
                    self._num_blocks -= 1
                    jv.append(version)
                    jh.append(h)
                    jf.append(code)
                    changed = True
            elif isinstance(event, AllBlocksCleared):
                self._reset("cleared", partial=False)
                version = self.version + 1
                jv, jh, jf = self._j_version, self._j_hash, self._j_flag
                changed = False
        # Turning partial (stores dropped at capacity) is news for receivers even when no
        # presence changed: a new version makes the agent send it.
        if changed or self.partial != was_partial:
            self.version = version
            if len(jv) > self.max_journal:
                self._trim_journal()

    def _unknown_medium(self, medium: str, num_hashes: int) -> None:
        self.num_unknown_medium_blocks += num_hashes
        # Clipped: it is the engine's string, and it ends up in a log line.
        self.last_unknown_medium = medium[:64]

    def _trim_journal(self) -> None:
        # Keep the newer half, cut at a version boundary so every retained base is exact.
        jv = self._j_version
        cut = len(jv) // 2
        cut_version = jv[cut]
        cut = bisect.bisect_left(jv, cut_version)
        if cut == 0:
            cut = bisect.bisect_right(jv, cut_version)
        self._floor = jv[cut - 1]
        self._j_version = jv[cut:]
        self._j_hash = self._j_hash[cut:]
        self._j_flag = self._j_flag[cut:]

    # --- reading ------------------------------------------------------------------------------

    def contains(self, block_hash: int | bytes, medium: str | None = None) -> bool:
        refs = self._refs.get(normalize_medium(medium))
        return refs is not None and _as_uint64(block_hash) in refs

    def refcount(self, block_hash: int | bytes, medium: str | None = None) -> int:
        refs = self._refs.get(normalize_medium(medium))
        return 0 if refs is None else refs.get(_as_uint64(block_hash), 0)

    def snapshot(self, reason: ResetReason = "requested") -> MirrorSnapshot:
        """Every present (hash, medium) now, as a full copy for a receiver."""
        blocks = {m: tuple(refs) for m, refs in self._refs.items() if refs}
        return MirrorSnapshot(self.version, blocks, reason, self.partial)

    def changes_since(self, base_version: int) -> MirrorDelta | MirrorSnapshot:
        """Net changes from ``base_version`` to now, or a snapshot when no delta can be exact.

        A snapshot comes back when a reset happened after ``base_version`` (its reason says
        which) or when the base is older than the journal or newer than this mirror.
        """
        if base_version == self.version:
            return MirrorDelta(base_version, self.version, partial=self.partial)
        if base_version > self.version:
            return self.snapshot("base_unknown")
        if base_version < self._reset_version:
            return self.snapshot(self.last_reset)
        if base_version < self._floor:
            return self.snapshot("base_unknown")
        start = bisect.bisect_right(self._j_version, base_version)
        first: dict[tuple[int, int], int] = {}
        setdefault = first.setdefault
        for h, flag in zip(self._j_hash[start:], self._j_flag[start:], strict=True):
            setdefault((flag >> 1, h), flag & 1)
        added: dict[str, list[int]] = {}
        removed: dict[str, list[int]] = {}
        for (code, h), was_add in first.items():
            medium = self._media[code]
            present = h in self._refs.get(medium, ())
            if was_add and present:
                added.setdefault(medium, []).append(h)
            elif not was_add and not present:
                removed.setdefault(medium, []).append(h)
        return MirrorDelta(
            base_version,
            self.version,
            {m: tuple(v) for m, v in added.items()},
            {m: tuple(v) for m, v in removed.items()},
            self.partial,
        )

    # --- persistence (bytes only; the agent decides where they live) --------------------------

    def dump(self) -> bytes:
        """The mirror's counts, seq and version as msgpack, for the agent's state dir.

        The journal is not kept: after a reload every receiver gets a snapshot once.
        """
        state = {
            "v": 1,
            "version": self.version,
            "last_seq": self.last_seq,
            "partial": self.partial,
            "store_mode": self.store_mode,
            "refs": {m: [list(refs), list(refs.values())] for m, refs in self._refs.items()},
        }
        return msgpack.packb(state, use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def load(cls, data: bytes, **kwargs: object) -> BlockMirror:
        """A mirror from ``dump()`` bytes; raises ``KVError`` if they are not one."""
        try:
            state = msgpack.unpackb(data, raw=False)
            mirror = cls(store_mode=state["store_mode"], **kwargs)  # type: ignore[arg-type]
            refs: dict[str, dict[int, int]] = {}
            for medium, (hashes, counts) in state["refs"].items():
                refs[str(medium)] = dict(zip(hashes, counts, strict=True))
            version = int(state["version"])
            last_seq = state["last_seq"]
            partial = bool(state["partial"])
        except KVError:
            raise
        except Exception as exc:
            raise KVError(
                f"mirror state is unreadable ({type(exc).__name__}); delete it and let the "
                "mirror refill from the engine (the view is partial until then)"
            ) from None
        mirror._refs = refs
        mirror._num_blocks = sum(len(r) for r in refs.values())
        mirror._media = list(refs)
        # The reloaded version must move past anything a receiver saw, and no journal survives.
        mirror.version = version + 1
        mirror._floor = mirror._reset_version = mirror.version
        mirror.last_reset = "base_unknown"
        mirror.last_seq = None if last_seq is None else int(last_seq)
        mirror.partial = partial
        return mirror
