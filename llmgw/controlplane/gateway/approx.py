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

Pure: time is passed in. This module must NOT do I/O, read clocks or import the control plane.
"""

from __future__ import annotations

import hashlib
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


class ApproxTree:
    """What this gateway sent where, per model, by chained chunk hashes; bounded, LRU + TTL."""

    def __init__(self, *, chunk_chars: int = 64, max_entries: int = 200_000, ttl_s: float = 600.0):
        if chunk_chars < 1 or max_entries < 1 or ttl_s <= 0:
            raise ValueError("ApproxTree needs chunk_chars >= 1, max_entries >= 1, ttl_s > 0")
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[str, int], dict[str, float]] = OrderedDict()

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
        depth = 0
        for h in chunks:
            entry = self._entries.get((model, h))
            if entry is None:
                break
            held = {r for r in alive if entry.get(r, -1e300) >= oldest}
            for gone in alive - held:
                depth_of[gone] = depth
            alive = held
            if not alive:
                break
            depth += 1
        for r in alive:
            depth_of[r] = depth
        return {r: d / total for r, d in depth_of.items()}

    def record(self, model: str, chunks: Sequence[int], replica: str, *, now: float) -> None:
        """Remember that ``replica`` was sent this prefix at ``now``."""
        entries = self._entries
        for h in chunks:
            key = (model, h)
            entry = entries.get(key)
            if entry is None:
                entries[key] = {replica: now}
            else:
                entry[replica] = now
                entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def drop(self, model: str, chunks: Sequence[int], replica: str) -> None:
        """Take back ``replica``'s claim on these chunks (what was sent never got there)."""
        for h in chunks:
            entry = self._entries.get((model, h))
            if entry is not None and entry.pop(replica, None) is not None and not entry:
                del self._entries[(model, h)]

    def forget(self, replica: str) -> None:
        """Drop a replica's claims (it restarted: its cache is empty)."""
        for key in [k for k, v in self._entries.items() if replica in v]:
            entry = self._entries[key]
            del entry[replica]
            if not entry:
                del self._entries[key]
