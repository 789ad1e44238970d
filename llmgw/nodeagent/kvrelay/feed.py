"""One watched engine as the KV relay holds it: what to watch (``WatchSpec``) and the state
kept for it (``Feed``: its SUB socket, its ``llmgw.kv`` mirror, its block size, when to probe).

A Feed's fields belong to the ingest thread (ingest.py, replay.py) except under ``Feed.lock``,
which readers on other threads (relay.py) take. This module must NOT open sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq

from llmgw.kv import BlockMirror, BlockStored, EventBatch

__all__ = ["Feed", "FrameFilter", "WatchSpec"]

# Test seam: (shard_id, seq) -> False drops the live frame as if the network had lost it.
FrameFilter = Callable[[str, int], bool]


@dataclass(frozen=True, slots=True)
class WatchSpec:
    shard_id: str
    sub_port: int
    replay_port: int | None
    model: str
    engine_generation: int


class Feed:
    """One engine's SUB socket and mirror. Fields are the ingest thread's except under ``lock``."""

    def __init__(self, spec: WatchSpec, mirror: BlockMirror) -> None:
        self.spec = spec
        self.topic = f"kv@{spec.shard_id}".encode()
        self.mirror = mirror
        self.lock = threading.Lock()
        self.block_size: int | None = None
        self.sub: zmq.Socket[bytes] | None = None
        self.persisted_version = -1
        self.next_probe_at = 0.0  # forward-fill from replay at once, then when idle
        self.last_live_at = 0.0
        # The mirror's num_unknown_medium_blocks already counted in the metrics, and whether
        # the warning was logged (once per engine watched: an engine sends the medium on
        # every store).
        self.unknown_medium_blocks = 0
        self.warned_unknown_medium = False

    def learn_block_size(self, batches: Iterable[EventBatch]) -> None:
        """The engine's GPU block size, from its first GPU store (offload events carry 0)."""
        for batch in batches:
            if self.block_size is not None:
                return
            for event in batch.events:
                if (
                    type(event) is BlockStored
                    and event.block_size
                    and event.medium in (None, "GPU")
                ):
                    self.block_size = event.block_size
                    break
