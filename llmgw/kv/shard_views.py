"""The shards' KV views: agents' KV delta requests applied to this process's in-memory prefix index.

Each control plane instance keeps its own ``PrefixIndex`` and rebuilds it from agents after a
restart (docs/architecture.md §5): there is no database on this path. Per shard it remembers only which
node fed it, the version it holds and whether that version is complete; everything else is in
the index.

Answers (``KvResult``):

- ``retry``: the shard is not placed (yet) as far as this instance knows, or it is placed on
  another node (a node reports only on its own shards; a report about someone else's is counted
  and ignored), or the engine hashes with another block size than the profile routes with.
- ``need_full``: the request is a delta whose base is not the version held (this instance
  restarted, a request was lost, or the agent reloaded its mirror): the agent sends a reset.
- ``ack``: applied.

Bounds (hardening-3 finding 7: one node's credential grew every instance's index by 3M hashes
for its own idle shard). A shard's view holds at most ``CAPACITY_SLACK`` times its engine's KV
capacity in blocks (``PlacedShard.max_blocks``, from the launched profile), or
``max_view_blocks`` when the profile does not fix it. A delta that would pass it is not
applied: the view is marked partial (the router distrusts it) and its version forgotten, so the
answer is ``need_full``; a full copy past it is not applied either (the view is left empty and
partial, the answer ``retry``: the agent backs off). Each is counted ("over_capacity") and
logged at warning once per shard. One request's size is the protocol's
``MAX_BLOCKS_PER_MESSAGE``, set so a request holds the loop ~10 ms at most.

"An instance may answer 429 + Retry-After to a full copy": after an instance restart every
agent sends resets at once, and admitting them all would stall the router's event loop; the
agent API rations them with a ``llmgw.ratelimit.TokenBucket``. Pure: the HTTP shell does the
I/O and maps ``KvStreamError`` to 400. This module must NOT do I/O, read clocks or import the node agent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.kv import PrefixIndex
from llmgw.logs import get_logger
from llmgw.protocol.kvstream import KvDeltaRequest, KvResult

__all__ = ["CAPACITY_SLACK", "DEFAULT_MAX_VIEW_BLOCKS", "PlacedShard", "ShardKvView", "ShardViews"]

_log = get_logger(__name__)

# Over the engine's capacity: a view briefly holds blocks the engine evicted before the delta
# that removes them arrives, and a CPU tier beside the GPU one; twice covers both.
CAPACITY_SLACK = 2.0
# A shard whose engine's capacity its profile does not fix: 2**20 blocks (~100 MB of index at
# ~95 bytes a hash), past any single engine's GPU cache (a 0.5B model on an 80 GB GPU holds
# ~350k blocks of 16 tokens).
DEFAULT_MAX_VIEW_BLOCKS = 1 << 20


@dataclass(frozen=True, slots=True)
class PlacedShard:
    """Where the control plane placed a shard, as the intake needs it.

    ``block_size`` is the profile's ``kv_hash.block_size``; None skips the check (a profile
    without precise routing).
    """

    node_id: str
    model: str
    block_size: int | None = None
    # The engine's KV capacity in blocks (``engines.kv_capacity``); None: unknown.
    max_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class ShardKvView:
    """What this instance holds for one shard, for debugging: every block, per medium."""

    shard_id: str
    model: str
    version: int
    complete: bool
    partial: bool
    blocks: dict[str, list[int]]  # medium -> sorted uint64 hashes

    @property
    def num_blocks(self) -> int:
        return sum(len(h) for h in self.blocks.values())


@dataclass(slots=True)
class _Held:
    node_id: str
    model: str
    version: int
    complete: bool


class ShardViews:
    """The agent-facing side of one instance's ``PrefixIndex``."""

    def __init__(
        self, index: PrefixIndex | None = None, *, max_view_blocks: int = DEFAULT_MAX_VIEW_BLOCKS
    ) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.max_view_blocks = max_view_blocks
        self._held: dict[str, _Held] = {}
        self._warned: set[str] = set()  # shards already logged over their bound
        # Why requests were not applied, and how many were: "unknown_shard", "foreign_node",
        # "block_size", "base_unknown", "over_capacity", and applied kinds "delta", "reset".
        # Exported as metrics
        # by the shell.
        self.counts: Counter[str] = Counter()

    def version(self, shard_id: str) -> int | None:
        """The version this instance holds for the shard (None: nothing)."""
        held = self._held.get(shard_id)
        return None if held is None else held.version

    def is_complete(self, shard_id: str) -> bool:
        held = self._held.get(shard_id)
        return held is not None and held.complete

    def not_whole(self) -> dict[str, str]:
        """Shard -> why the router cannot trust its view whole: "partial" (the agent said it
        lost events) or "incomplete" (no full copy here yet). For the console's "needs
        attention"; one pass over the shards held, not over their blocks."""
        out = {}
        for shard_id, held in self._held.items():
            if self.index.is_partial(shard_id):
                out[shard_id] = "partial"
            elif not held.complete:
                out[shard_id] = "incomplete"
        return out

    def view(self, shard_id: str) -> ShardKvView | None:
        """Everything held for the shard (None: nothing). Walks the model's whole table, so it
        is for the debug endpoint and tests, never for a request path."""
        held = self._held.get(shard_id)
        if held is None:
            return None
        return ShardKvView(
            shard_id=shard_id,
            model=held.model,
            version=held.version,
            complete=held.complete,
            partial=self.index.is_partial(shard_id),
            blocks=self.index.blocks(shard_id),
        )

    def apply(
        self, node_id: str, request: KvDeltaRequest, placed: Mapping[str, PlacedShard]
    ) -> KvResult:
        """Apply one request from ``node_id`` (authenticated by the shell) or say why not."""
        shard = request.shard_id
        where = placed.get(shard)
        if where is None:
            self.counts["unknown_shard"] += 1
            return "retry"
        if where.node_id != node_id:
            self.counts["foreign_node"] += 1
            _log.warning(
                "kv_delta_foreign_shard", node=node_id, shard=shard, placed_on=where.node_id
            )
            return "retry"
        if (
            where.block_size is not None
            and request.block_size
            and request.block_size != where.block_size
        ):
            # The router hashes prompts with the profile's block size: a view hashed with
            # another can only produce false misses, and indexing it would hide the fault.
            self.counts["block_size"] += 1
            self.drop(shard)
            _log.warning(
                "kv_delta_block_size_mismatch",
                node=node_id,
                shard=shard,
                engine_block_size=request.block_size,
                profile_block_size=where.block_size,
            )
            return "retry"
        held = self._held.get(shard)
        if held is not None and (held.node_id != node_id or held.model != where.model):
            # The shard moved (or its model changed): what we hold describes another engine.
            self.drop(shard)
            held = None
        partial = request.partial or not request.complete
        bound = self.bound(where)
        if request.reset:
            if request.num_blocks > bound:
                self._over(node_id, shard, request.num_blocks, bound)
                self.index.apply_snapshot(where.model, shard, {}, partial=True)
                self._held[shard] = _Held(node_id, where.model, -1, False)
                return "retry"
            blocks = {m: h for m, h in request.added.items() if len(h)}
            self.index.apply_snapshot(where.model, shard, blocks, partial=partial)
            self._held[shard] = _Held(node_id, where.model, request.new_version, request.complete)
            self.counts["reset"] += 1
            return "ack"
        if held is None or held.version != request.base_version:
            self.counts["base_unknown"] += 1
            return "need_full"
        grows = sum(map(len, request.added.values())) - sum(map(len, request.removed.values()))
        if self.index.num_blocks(shard) + grows > bound:
            self._over(node_id, shard, self.index.num_blocks(shard) + grows, bound)
            self.index.apply_delta(where.model, shard, partial=True)
            held.version = -1  # the next request is answered need_full
            held.complete = False
            return "need_full"
        for medium in {*request.added, *request.removed}:
            self.index.apply_delta(
                where.model,
                shard,
                request.added.get(medium, ()),
                request.removed.get(medium, ()),
                medium=medium,
            )
        self.index.apply_delta(where.model, shard, partial=partial)
        held.version = request.new_version
        held.complete = request.complete
        self.counts["delta"] += 1
        return "ack"

    def bound(self, where: PlacedShard) -> int:
        """The most blocks the shard's view may hold."""
        if where.max_blocks:
            return int(where.max_blocks * CAPACITY_SLACK)
        return self.max_view_blocks

    def _over(self, node_id: str, shard: str, blocks: int, bound: int) -> None:
        self.counts["over_capacity"] += 1
        if shard not in self._warned:
            self._warned.add(shard)
            _log.warning(
                "kv_view_over_capacity",
                node=node_id,
                shard=shard,
                blocks=blocks,
                bound=bound,
                fix="the engine reports more KV blocks than its profile's capacity allows: "
                "check its args (--num-gpu-blocks-override, --num-blocks) or the node",
            )

    def drop(self, shard_id: str) -> None:
        """Forget a shard (stopped, moved, its node gone)."""
        self._held.pop(shard_id, None)
        self.index.drop_shard(shard_id)

    def forget_unplaced(self, placed: Mapping[str, PlacedShard]) -> list[str]:
        """Drop every held shard no longer placed where its feeder is; returns their ids."""
        gone = [
            shard
            for shard, held in self._held.items()
            if (where := placed.get(shard)) is None
            or where.node_id != held.node_id
            or where.model != held.model
        ]
        for shard in gone:
            self.drop(shard)
            self._warned.discard(shard)
        return gone
