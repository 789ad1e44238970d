"""The KV relay's Prometheus metrics, registered on the registry the agent passes in.

Label children used per batch are cached per shard (``for_shard``): a ``labels()`` lookup costs
a dict probe and a lock per call, which at tens of thousands of batches a second is the relay's
second-largest cost after decoding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["RelayMetrics", "ShardCounters"]


@dataclass(frozen=True, slots=True)
class ShardCounters:
    batches: Counter
    block_events: Counter
    malformed: Counter
    foreign: Counter
    cleared: Counter
    blocks: Gauge


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "llmgw_agent_kv_"
        self.batches = Counter(
            p + "batches", "KV event batches received live, per shard.", ["shard"],
            registry=registry,
        )  # fmt: skip
        self.block_events = Counter(
            p + "block_events", "Block hashes in stored and removed events received live.",
            ["shard"], registry=registry,
        )  # fmt: skip
        self.malformed = Counter(
            p + "malformed_frames", "Frames or replayed batches dropped as undecodable.",
            ["shard"], registry=registry,
        )  # fmt: skip
        self.foreign = Counter(
            p + "foreign_frames",
            "Frames on a shard's SUB with another topic or shape (a stale engine's PUB).",
            ["shard"], registry=registry,
        )  # fmt: skip
        self.gaps = Counter(
            p + "gaps", "Sequence gaps, by outcome: filled from replay or reset to partial.",
            ["shard", "outcome"], registry=registry,
        )  # fmt: skip
        self.resets = Counter(
            p + "resets", "Mirror resets, by reason (engine_restart, cleared, gap).",
            ["shard", "reason"], registry=registry,
        )  # fmt: skip
        self.replay_timeouts = Counter(
            p + "replay_timeouts", "Replay requests the engine did not answer in time.",
            ["shard"], registry=registry,
        )  # fmt: skip
        self.unknown_media = Counter(
            p + "unknown_medium_blocks",
            "Block hashes in events on a medium llmgw does not know (not GPU, CPU or STORAGE): "
            "dropped, never indexed.",
            ["shard"], registry=registry,
        )  # fmt: skip
        self.state_errors = Counter(
            p + "state_errors", "Persisted mirrors that could not be read (started empty).",
            registry=registry,
        )  # fmt: skip
        self.blocks = Gauge(
            p + "blocks", "Distinct (hash, medium) pairs in the shard's mirror.", ["shard"],
            registry=registry,
        )  # fmt: skip
        self.partial = Gauge(
            p + "partial", "1 while the shard's view may lack blocks.", ["shard"],
            registry=registry,
        )  # fmt: skip
        self.sends = Counter(
            p + "sends", "Requests sent to a control plane instance, by kind.",
            ["instance", "kind"], registry=registry,
        )  # fmt: skip
        self.results = Counter(
            p + "results",
            "Answers per instance: ack, retry, need_full, throttled (429), error.",
            ["instance", "result"], registry=registry,
        )  # fmt: skip
        self.lag = Gauge(
            p + "relay_lag_seconds",
            "Age of the oldest change an instance has not acknowledged (0 when current).",
            ["instance"], registry=registry,
        )  # fmt: skip
        self._shards: dict[str, ShardCounters] = {}

    def for_shard(self, shard: str) -> ShardCounters:
        found = self._shards.get(shard)
        if found is None:
            found = self._shards[shard] = ShardCounters(
                batches=self.batches.labels(shard=shard),
                block_events=self.block_events.labels(shard=shard),
                malformed=self.malformed.labels(shard=shard),
                foreign=self.foreign.labels(shard=shard),
                cleared=self.resets.labels(shard=shard, reason="cleared"),
                blocks=self.blocks.labels(shard=shard),
            )
        return found

    def forget_shard(self, shard: str) -> None:
        """Drop a gone shard's series so /metrics does not grow with every shard ever run."""
        self._shards.pop(shard, None)
        for metric in (self.batches, self.block_events, self.malformed, self.foreign,
                       self.replay_timeouts, self.blocks, self.partial,
                       self.unknown_media):  # fmt: skip
            _remove(metric, shard)
        for outcome in ("filled", "reset"):
            _remove(self.gaps, shard, outcome)
        for reason in ("engine_restart", "cleared", "gap"):
            _remove(self.resets, shard, reason)

    def forget_instance(self, instance: str) -> None:
        for kind in ("delta", "full", "keepalive"):
            _remove(self.sends, instance, kind)
        for result in ("ack", "retry", "need_full", "throttled", "error"):
            _remove(self.results, instance, result)
        _remove(self.lag, instance)


def _remove(metric: Counter | Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)
