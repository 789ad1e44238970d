"""Tier 2 of routing: a bounded prefix tree of what this gateway sent where, per model.

A prompt's text is cut into fixed chunks of characters, each named by a hash chained from the
previous one (like KV blocks: a chunk's name stands for the whole prefix up to it), so the
tree is a flat map ``(model, chunk hash) -> {replica: last sent}`` and scoring a prompt is one
probe per leading chunk, the same walk ``PrefixIndex.score`` does over KV blocks.

Memory is bounded by ``max_entries`` chunk entries over all models: least recently touched
first out (an ``OrderedDict`` moved to the end on every record). A replica's claim on a chunk
older than ``ttl_s`` no longer scores: the engine has most likely evicted the blocks since.
Without tokens, characters stand in for them: what the tree can say is "this replica was sent
this prefix recently", never that it still holds it; the precise tier exists for that.

The tree also counts where prompts part (``fork_shares``): per chunk, how many recent prompts
continued otherwise than the one recorded before them (a decayed count, half-life
``fork_half_life_s``), as a share of the model's recent prompts. Turns of one chat extend each
other and never part; different chats part right after the system prompt they share, so the
count at a prefix's last chunk measures how much traffic of distinct sessions it carries, which
says how many replicas deserve a copy (router.hot_share).

Pure: time is passed in. This module must NOT do I/O, read clocks or import the control plane.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["ApproxTree", "chunk_hashes"]


def chunk_hashes(text: str, chunk_chars: int) -> list[int]:
    """The chained 64-bit names of the text's full chunks (a partial tail gets none)."""
    data = text.encode("utf-8", "surrogatepass")
    out: list[int] = []
    parent = b""
    step = chunk_chars
    for start in range(0, len(data) - step + 1, step):
        digest = hashlib.blake2b(parent + data[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "big"))
        parent = digest
    return out


# Fork shares say nothing until a model has seen this many prompts (decayed): the second
# prompt ever would otherwise make whatever it shares with the first look like everyone's.
_MIN_PROMPTS = 8.0
# Models (tree keys: model and cache salt) whose prompt count is kept, least recent out.
_MAX_MODELS = 4096
# Restarted replicas remembered at once, past which floors older than the TTL are dropped.
_MAX_FLOORS = 1024


class _Decaying:
    """A count that halves every half-life: ``count`` as of ``at``."""

    __slots__ = ("at", "count")

    def __init__(self) -> None:
        self.count = 0.0
        self.at = 0.0

    def value(self, now: float, half_life_s: float) -> float:
        if not self.count or now <= self.at:
            return self.count
        return self.count * math.exp2(-(now - self.at) / half_life_s)

    def add(self, now: float, half_life_s: float) -> None:
        self.count = self.value(now, half_life_s) + 1.0
        self.at = now


class _Entry(_Decaying):
    """One chunk: who was sent it when, and (its count) how many recent prompts parted right
    after it, continuing otherwise than the prompt recorded before them."""

    __slots__ = ("after", "sent")

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, float] = {}  # replica -> when it was last sent this prefix
        self.after: int | None = None  # the chunk that followed it in the last prompt recorded


class ApproxTree:
    """What this gateway sent where, per model, by chained chunk hashes; bounded, LRU + TTL.

    ``fork_half_life_s``: None counts no forks (a tree of claims only, whose ``now`` may be
    +inf: claimed until further notice)."""

    def __init__(
        self,
        *,
        chunk_chars: int = 64,
        max_entries: int = 200_000,
        ttl_s: float = 600.0,
        fork_half_life_s: float | None = 60.0,
    ):
        if chunk_chars < 1 or max_entries < 1 or ttl_s <= 0:
            raise ValueError("ApproxTree needs chunk_chars >= 1, max_entries >= 1, ttl_s > 0")
        if fork_half_life_s is not None and fork_half_life_s <= 0:
            raise ValueError("ApproxTree needs fork_half_life_s > 0 (or None: no fork counts)")
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.fork_half_life_s = fork_half_life_s
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._prompts: OrderedDict[str, _Decaying] = OrderedDict()  # model -> prompts recorded
        self._floors: dict[str, float] = {}  # replica -> claims before this do not score

    def __len__(self) -> int:
        return len(self._entries)

    def num_entries(self, model: str) -> int:
        """Chunk entries held for the model (a walk: for metrics, not for requests)."""
        return sum(1 for m, _ in self._entries if m == model)

    def chunks(self, text: str) -> list[int]:
        return chunk_hashes(text, self.chunk_chars)

    def score(
        self, model: str, chunks: Sequence[int], replicas: Iterable[str], *, now: float
    ) -> dict[str, float]:
        """Each replica's share of the prompt's leading chunks it was sent within the TTL."""
        names = list(replicas)
        depth_of = dict.fromkeys(names, 0)
        total = len(chunks)
        if not total or not names:
            return dict.fromkeys(names, 0.0)
        alive = set(names)
        oldest = now - self.ttl_s
        floors = self._floors
        since = {r: max(oldest, floors.get(r, oldest)) for r in names}
        depth = 0
        for h in chunks:
            entry = self._entries.get((model, h))
            if entry is None:
                break
            sent = entry.sent
            held = {r for r in alive if sent.get(r, -1e300) >= since[r]}
            for gone in alive - held:
                depth_of[gone] = depth
            alive = held
            if not alive:
                break
            depth += 1
        for r in alive:
            depth_of[r] = depth
        return {r: d / total for r, d in depth_of.items()}

    def fork_shares(self, model: str, chunks: Sequence[int], *, now: float) -> list[float]:
        """Per leading chunk the tree knows (it stops at the first it does not): the share of
        the model's recent prompts that parted from the prompt before them right after it.
        Empty while the model has seen too few prompts for a share to mean anything."""
        half = self.fork_half_life_s
        count = self._prompts.get(model)
        if half is None or count is None:
            return []
        prompts = count.value(now, half)
        if prompts < _MIN_PROMPTS:
            return []
        out: list[float] = []
        for h in chunks:
            entry = self._entries.get((model, h))
            if entry is None:
                break
            out.append(min(1.0, entry.value(now, half) / prompts))
        return out

    def record(self, model: str, chunks: Sequence[int], replica: str, *, now: float) -> None:
        """Remember that ``replica`` was sent this prefix at ``now`` (and, counting forks,
        where this prompt parted from the one recorded before it)."""
        entries = self._entries
        half = self.fork_half_life_s
        last = len(chunks) - 1
        for i, h in enumerate(chunks):
            key = (model, h)
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = _Entry()
            else:
                entries.move_to_end(key)
            entry.sent[replica] = now
            if half is None or i == last:
                continue  # a prompt that ends here parts from nothing: the next turn extends it
            after = chunks[i + 1]
            if entry.after is not None and entry.after != after:
                entry.add(now, half)
            entry.after = after
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        if half is not None and chunks:
            count = self._prompts.get(model)
            if count is None:
                count = self._prompts[model] = _Decaying()
            else:
                self._prompts.move_to_end(model)
            count.add(now, half)
            while len(self._prompts) > _MAX_MODELS:
                self._prompts.popitem(last=False)

    def drop(self, model: str, chunks: Sequence[int], replica: str) -> None:
        """Take back ``replica``'s claim on these chunks (what was sent never got there)."""
        for h in chunks:
            entry = self._entries.get((model, h))
            if entry is not None and entry.sent.pop(replica, None) is not None and not entry.sent:
                del self._entries[(model, h)]

    def forget(self, replica: str, *, now: float) -> None:
        """Claims on ``replica`` made before ``now`` no longer score (its engine restarted:
        the cache is empty). O(1): a floor per replica, not a walk over every entry while
        requests wait; the claims themselves age out of the LRU as usual."""
        floors = self._floors
        floors[replica] = now
        if len(floors) > _MAX_FLOORS:
            # Past the TTL a floor hides nothing the TTL does not: only recent ones matter.
            for gone in [r for r, at in floors.items() if at < now - self.ttl_s]:
                del floors[gone]
