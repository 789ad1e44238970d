"""What the KV relay sends one control plane instance about one shard, and when (pure).

Per (instance, shard) the agent remembers the version the instance acknowledged. A send is the
mirror's ``changes_since(acked)``: a delta, or a reset plus full copy when the instance holds
nothing we know of (first contact, ``need_full``, a reset in the mirror). Answers move the state:
``ack`` advances ``acked``; ``need_full`` forgets it and schedules a full copy after a random
jitter (a restarted instance would otherwise receive every engine's full copy in the same
instant); ``retry`` and transport errors back off exponentially; a 429 waits its Retry-After.

Deltas are coalesced by construction: while a request is in flight the mirror keeps moving, and
the next send covers everything since the last ack in one request.

This module must NOT do I/O, read clocks or draw random numbers itself: the shell passes
``now`` and ``rand`` in, so the property tests drive it exactly as the relay does.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.kv import BlockMirror, MirrorSnapshot
from llmgw.protocol.kvstream import MAX_BLOCKS_PER_MESSAGE, KvDeltaRequest, chunk_change

__all__ = ["ShardStream", "StreamTiming", "plan_requests"]


def plan_requests(
    shard_id: str,
    mirror: BlockMirror,
    acked: int | None,
    *,
    block_size: int | None,
    max_blocks: int = MAX_BLOCKS_PER_MESSAGE,
    keepalive: bool = False,
) -> list[KvDeltaRequest]:
    """The requests that bring an instance holding ``acked`` to ``mirror.version``; [] if none.

    ``acked=None`` means the instance holds nothing usable: a reset with the full view. With
    ``keepalive``, an instance already at the mirror's version gets an empty delta anyway: an
    instance that restarted under the same id while the engine sat idle answers it with
    ``need_full``, where silence would leave it without this shard's view indefinitely.
    """
    if acked is not None and acked == mirror.version:
        if not keepalive:
            return []
        return [
            KvDeltaRequest(
                shard_id=shard_id,
                base_version=acked,
                new_version=acked,
                partial=mirror.partial,
                block_size=block_size,
            )
        ]
    change = mirror.snapshot("requested") if acked is None else mirror.changes_since(acked)
    if isinstance(change, MirrorSnapshot):
        return chunk_change(
            shard_id=shard_id,
            base_version=0,
            new_version=change.version,
            reset=True,
            partial=change.partial,
            block_size=block_size,
            added=change.blocks,
            removed={},
            max_blocks=max_blocks,
        )
    assert acked is not None
    return chunk_change(
        shard_id=shard_id,
        base_version=acked,
        new_version=change.version,
        reset=False,
        partial=change.partial,
        block_size=block_size,
        added=change.added,
        removed=change.removed,
        max_blocks=max_blocks,
    )


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """Back-off and jitter of one stream; seconds."""

    full_copy_jitter_s: float = 1.0
    retry_min_s: float = 0.5
    retry_max_s: float = 10.0


@dataclass(slots=True)
class ShardStream:
    """One instance's knowledge of one shard, as the agent tracks it."""

    acked: int | None = None  # version the instance holds; None: it needs a full copy
    not_before: float = 0.0  # no send before this time (back-off, jitter, Retry-After)
    retry_delay_s: float = 0.0  # the current back-off step; 0 after a success
    acked_at: float | None = None  # when the last ack arrived (relay lag is measured from it)

    def due(self, now: float) -> bool:
        return now >= self.not_before

    def on_ack(self, new_version: int, now: float) -> None:
        self.acked = new_version
        self.retry_delay_s = 0.0
        self.acked_at = now

    def on_need_full(self, now: float, rand: float, timing: StreamTiming) -> None:
        self.acked = None
        self.not_before = now + rand * timing.full_copy_jitter_s

    def on_retry(self, now: float, rand: float, timing: StreamTiming) -> None:
        """``retry`` or a failed request: exponential back-off with jitter (half to full step)."""
        step = max(timing.retry_min_s, min(timing.retry_max_s, self.retry_delay_s * 2))
        self.retry_delay_s = step
        self.not_before = now + step * (0.5 + rand / 2)

    def on_throttled(self, now: float, retry_after_s: float, rand: float) -> None:
        """429 to a full copy: wait what the instance asked, plus up to 10% so peers spread."""
        self.not_before = now + retry_after_s * (1.0 + rand / 10)
