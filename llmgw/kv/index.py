"""The router's prefix index: which shards hold which KV blocks, per model, and prompt scoring.

Holds ``PrefixIndex``. Per model and medium it keeps ONE dict ``hash64 -> bitmask`` whose bits
are the model's shard slots, instead of a set per shard: a prompt is scored with one dict probe
per leading block whatever the number of replicas (per-shard sets cost one probe per replica per
block), and a hash held by several shards is stored once. A mask held by one shard is the very
int object of its slot bit, so the common case allocates nothing but the dict entry.

Replacing a shard's contents (a full copy after a reset, or dropping the shard) does not walk
the dict: the shard gets a fresh slot and the old bit becomes garbage that no candidate mask can
match; a compaction pass reclaims dead bits once they outweigh a quarter of the live entries, so
the cost is amortised over the inserts that made the garbage.

Input is what agents send (docs/architecture.md §5): per shard, uint64 hashes added and removed per medium
since a version, or a full copy; ``apply_change`` takes a ``MirrorDelta``/``MirrorSnapshot``.
The index keeps no versions: the shell that talks to agents tracks them. Not thread-safe.
This module must NOT do I/O or import the control plane: the router wraps it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.kv.errors import KVError
from llmgw.kv.mirror import MirrorDelta, MirrorSnapshot, normalize_medium

__all__ = ["PrefixIndex", "PrefixScore"]

_GARBAGE_MIN = 4096  # never compact for less: a pass has a fixed cost


@dataclass(frozen=True, slots=True)
class PrefixScore:
    """How much of a prompt's leading blocks one shard holds."""

    shard: str
    matched_blocks: int
    share: float  # matched_blocks / blocks scored, 0.0 for an empty prompt
    partial: bool  # the shard's view may lack blocks: route by the approximate tier instead


@dataclass(slots=True)
class _Model:
    # medium -> {hash64: bitmask of slots}
    media: dict[str, dict[int, int]] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    shard_of: dict[int, str] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)  # slot -> (hash, medium) entries
    free: list[int] = field(default_factory=list)
    next_slot: int = 0
    dead_mask: int = 0
    dead_entries: int = 0


class PrefixIndex:
    """Per model: block hash -> shards holding it (per medium); scores prompts by leading blocks."""

    def __init__(self) -> None:
        self._models: dict[str, _Model] = {}
        self._model_of: dict[str, str] = {}  # shard -> model
        self._partial: set[str] = set()

    # --- shape --------------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted(self._models)

    def shards(self, model: str) -> list[str]:
        m = self._models.get(model)
        return sorted(m.slot_of) if m else []

    def num_blocks(self, shard: str) -> int:
        """(hash, medium) entries the shard holds (0 for an unknown shard)."""
        model = self._model_of.get(shard)
        if model is None:
            return 0
        m = self._models[model]
        return m.counts.get(m.slot_of[shard], 0)

    def num_entries(self, model: str) -> int:
        """(block, shard) pairs of live shards in the model (dead bits excluded)."""
        m = self._models.get(model)
        return sum(m.counts.values()) if m else 0

    def is_partial(self, shard: str) -> bool:
        return shard in self._partial

    def blocks(self, shard: str) -> dict[str, list[int]]:
        """The shard's block hashes per medium, sorted: for debugging and comparing views.

        O(entries of the shard's model): a diagnostic, never on the routing path. Dead bits of
        retired slots never collide with a live slot's bit, so the walk is exact.
        """
        model = self._model_of.get(shard)
        if model is None:
            return {}
        m = self._models[model]
        bit = 1 << m.slot_of[shard]
        out = {
            medium: sorted(h for h, mask in table.items() if mask & bit)
            for medium, table in m.media.items()
        }
        return {medium: hashes for medium, hashes in out.items() if hashes}

    # --- ingest -------------------------------------------------------------------------------

    def _slot(self, model: str, shard: str) -> tuple[_Model, int]:
        owner = self._model_of.get(shard)
        if owner is not None and owner != model:
            # A shard serves one model; a report under another name is a routing bug upstream.
            raise KVError(
                f"shard {shard!r} is indexed under model {owner!r}, not {model!r}; "
                "drop_shard it before reusing the id",
                field="shard",
            )
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model()
        slot = m.slot_of.get(shard)
        if slot is None:
            slot = m.free.pop() if m.free else m.next_slot
            if slot == m.next_slot:
                m.next_slot += 1
            m.slot_of[shard] = slot
            m.shard_of[slot] = shard
            m.counts[slot] = 0
            self._model_of[shard] = model
        return m, slot

    def apply_delta(
        self,
        model: str,
        shard: str,
        added: Collection[int] = (),
        removed: Iterable[int] = (),
        *,
        medium: str | None = "GPU",
        partial: bool | None = None,
    ) -> None:
        """Blocks the shard gained and lost in ``medium`` (uint64 hashes, removals first)."""
        # Deltas arrive thousands of times a second: skip the registration path when known.
        if self._model_of.get(shard) == model:
            m = self._models[model]
            slot = m.slot_of[shard]
        else:
            m, slot = self._slot(model, shard)
        if partial is not None:
            self._set_partial(shard, partial)
        key = "GPU" if medium == "GPU" else normalize_medium(medium)
        table = m.media.get(key)
        if table is None:
            table = m.media[key] = {}
        bit = 1 << slot
        count = m.counts[slot]
        if removed:
            get = table.get
            for h in removed:
                mask = get(h)
                if mask is None or not mask & bit:
                    continue
                mask ^= bit
                if mask:
                    table[h] = mask
                else:
                    del table[h]
                count -= 1
        if added:
            # Bulk path: build the new entries in C, then fix up only the hashes another shard
            # (or a repeat) already holds; a per-hash Python loop would cost 3x the bare set.
            common = table.keys() & added
            fresh = dict.fromkeys(added, bit)
            count += len(fresh)
            for h in common:
                mask = table[h]
                if mask & bit:
                    count -= 1
                    fresh[h] = mask
                else:
                    fresh[h] = mask | bit
            table.update(fresh)
        m.counts[slot] = count

    def apply_snapshot(
        self,
        model: str,
        shard: str,
        blocks: Mapping[str, Collection[int]],
        *,
        partial: bool = False,
    ) -> None:
        """Replace everything the shard holds with ``blocks`` (medium -> uint64 hashes)."""
        self._retire(shard)
        for medium, hashes in blocks.items():
            self.apply_delta(model, shard, hashes, medium=medium)
        self._slot(model, shard)  # an empty copy still registers the shard
        self._set_partial(shard, partial)

    def apply_change(self, model: str, shard: str, change: MirrorDelta | MirrorSnapshot) -> None:
        """Apply what a shard's mirror produced (a delta, or a snapshot that replaces all)."""
        if isinstance(change, MirrorSnapshot):
            self.apply_snapshot(model, shard, change.blocks, partial=change.partial)
            return
        for medium in {*change.added, *change.removed}:
            self.apply_delta(
                model,
                shard,
                change.added.get(medium, ()),
                change.removed.get(medium, ()),
                medium=medium,
            )
        self._slot(model, shard)
        self._set_partial(shard, change.partial)

    def drop_shard(self, shard: str) -> None:
        """Forget the shard (stopped, moved or its node gone)."""
        model = self._retire(shard)
        if model is not None:
            m = self._models[model]
            if not m.slot_of and not m.dead_entries:
                del self._models[model]
        self._partial.discard(shard)

    def _set_partial(self, shard: str, partial: bool) -> None:
        if partial:
            self._partial.add(shard)
        else:
            self._partial.discard(shard)

    def _retire(self, shard: str) -> str | None:
        model = self._model_of.pop(shard, None)
        if model is None:
            return None
        m = self._models[model]
        slot = m.slot_of.pop(shard)
        del m.shard_of[slot]
        entries = m.counts.pop(slot)
        if entries:
            m.dead_mask |= 1 << slot
            m.dead_entries += entries
            live = sum(m.counts.values())
            if m.dead_entries > max(_GARBAGE_MIN, live // 4):
                self._compact(m)
        else:
            m.free.append(slot)
        return model

    def _compact(self, m: _Model) -> None:
        keep = ~m.dead_mask
        for medium, table in m.media.items():
            m.media[medium] = {h: kept for h, mask in table.items() if (kept := mask & keep)}
        dead = m.dead_mask
        while dead:
            low = dead & -dead
            m.free.append(low.bit_length() - 1)
            dead ^= low
        m.dead_mask = 0
        m.dead_entries = 0

    def compact(self) -> None:
        """Reclaim every dead slot now (normally automatic; for tests and quiet moments)."""
        for m in self._models.values():
            if m.dead_mask:
                self._compact(m)

    # --- scoring ------------------------------------------------------------------------------

    def score(
        self,
        model: str,
        block_hashes: Sequence[int],
        candidates: Iterable[str],
        *,
        media: Iterable[str] | None = None,
    ) -> dict[str, PrefixScore]:
        """Each candidate's run of consecutive held blocks from the prompt's first block.

        ``block_hashes`` are the prompt's uint64 hashes in order; the caller leaves out the last
        block when the prompt length is a multiple of the block size (vLLM never hits it).
        ``media`` limits which tiers count (default: all). Unknown candidates score 0.
        """
        m = self._models.get(model)
        total = len(block_hashes)
        names = list(candidates)
        matched = dict.fromkeys(names, 0)
        if m is not None and total:
            alive = 0
            for name in names:
                slot = m.slot_of.get(name)
                if slot is not None:
                    alive |= 1 << slot
            if media is None:
                tables = list(m.media.values())
            else:
                tables = [t for k in media if (t := m.media.get(normalize_medium(k)))]
            depth = 0
            if alive and tables:
                if len(tables) == 1:
                    get = tables[0].get
                    for h in block_hashes:
                        held = alive & get(h, 0)
                        if held != alive:
                            self._record(m, alive ^ held, depth, matched)
                            alive = held
                            if not alive:
                                break
                        depth += 1
                else:
                    for h in block_hashes:
                        mask = 0
                        for table in tables:
                            mask |= table.get(h, 0)
                        held = alive & mask
                        if held != alive:
                            self._record(m, alive ^ held, depth, matched)
                            alive = held
                            if not alive:
                                break
                        depth += 1
                if alive:
                    self._record(m, alive, depth, matched)
        return {
            name: PrefixScore(name, n, n / total if total else 0.0, name in self._partial)
            for name, n in matched.items()
        }

    @staticmethod
    def _record(m: _Model, bits: int, depth: int, matched: dict[str, int]) -> None:
        while bits:
            low = bits & -bits
            matched[m.shard_of[low.bit_length() - 1]] = depth
            bits ^= low
