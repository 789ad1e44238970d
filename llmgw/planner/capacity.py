"""Free capacity per node during one reconcile pass, and which GPUs a profile may use.

Built once per pass from the snapshot (every shard not yet released holds its
GPUs, threads and leader port), then updated as the pass places replicas, so
two replicas placed in one pass never get the same GPU. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from llmgw.planner.snapshot import (
    GPU,
    SIM_GPU_CLASS,
    DeploymentId,
    NodeId,
    NodeView,
    PlanSettings,
    Snapshot,
)

__all__ = ["Capacity", "GPUClassifier", "NodeCapacity", "node_is_syncing"]

# "Not computed yet" for cached values whose computed value may be None.
_UNKNOWN = object()

# The engine that may run on simulated GPUs, and the only one.
_SIM_ENGINE = "sim"


def node_is_syncing(node: NodeView, now: datetime, settings: PlanSettings) -> bool:
    """Whether the node's agent synced within the grace period."""
    if node.last_sync_at is None:
        return False
    return (now - node.last_sync_at).total_seconds() <= settings.sync_grace_s


class GPUClassifier:
    """Matches NVML GPU names to profile GPU classes by the configured patterns.

    A class with no pattern matches names containing it, case-insensitively
    ("h100" matches "NVIDIA H100 80GB HBM3"), so a small cluster needs no
    configuration; a pattern overrides that, e.g. to tell "H100 NVL" apart.
    """

    __slots__ = ("_cache", "_patterns", "_sim")

    def __init__(self, patterns: tuple[tuple[str, str], ...]) -> None:
        self._patterns = {cls: re.compile(p) for cls, p in patterns}
        self._sim = self._patterns.get(SIM_GPU_CLASS, re.compile("^sim$"))
        self._cache: dict[tuple[str, str], bool] = {}

    def is_sim(self, gpu_name: str) -> bool:
        return gpu_name == SIM_GPU_CLASS or self._sim.search(gpu_name) is not None

    def matches(self, gpu_class: str, gpu_name: str) -> bool:
        key = (gpu_class, gpu_name)
        hit = self._cache.get(key)
        if hit is None:
            pattern = self._patterns.get(gpu_class)
            if pattern is not None:
                hit = pattern.search(gpu_name) is not None
            else:
                hit = gpu_class.lower() in gpu_name.lower()
            self._cache[key] = hit
        return hit

    def usable(self, gpu: GPU, gpu_class: str, engine: str, mig_allowed: bool) -> bool:
        """Whether a profile of this class and engine may run on the GPU at all."""
        # Simulated GPUs do not exist: a real engine placed there would never start.
        if self.is_sim(gpu.name) and engine != _SIM_ENGINE:
            return False
        if gpu.mig and not mig_allowed:
            return False
        return self.matches(gpu_class, gpu.name)


@dataclass(slots=True)
class NodeCapacity:
    """One node's free capacity; mutated only by `Capacity.reserve` within a pass."""

    node: NodeView
    syncing: bool
    used_keys: set[str] = field(default_factory=set)
    # Whole GPUs with at least one MIG instance in use: the GPU itself is not free.
    used_parents: set[int] = field(default_factory=set)
    used_ports: set[int] = field(default_factory=set)
    used_threads: int = 0
    # Live replicas of each deployment with a shard here: what spreading reads.
    deployments: Counter[DeploymentId] = field(default_factory=Counter)
    # placement's free GPUs per (class, engine, MIG allowed), dropped on every reservation.
    units_cache: dict[tuple[str, str, bool], dict[str, list[GPU]]] = field(default_factory=dict)
    _in_order: tuple[GPU, ...] | None = None
    _port: int | object | None = _UNKNOWN

    @property
    def gpus_in_order(self) -> tuple[GPU, ...]:
        """MIG instances first, then by index: the order placement hands GPUs out in.
        Computed on first use: a pass that places nothing never needs it."""
        if self._in_order is None:
            self._in_order = tuple(sorted(self.node.gpus, key=lambda g: (not g.mig, g.index)))
        return self._in_order

    def gpu_free(self, gpu: GPU) -> bool:
        if gpu.key in self.used_keys:
            return False
        if gpu.mig:
            # A MIG instance and its parent GPU are never both handed out.
            return str(gpu.mig_parent) not in self.used_keys
        return gpu.index not in self.used_parents

    def untouched(self) -> bool:
        return not self.used_keys and self.used_threads == 0

    def free_threads(self) -> int:
        return max(self.node.cpu_threads - self.used_threads, 0)

    def free_port(self, settings: PlanSettings) -> int | None:
        """The lowest leader port no live shard on this node holds (cached until a reservation)."""
        if self._port is _UNKNOWN:
            self._port = next(
                (
                    p
                    for p in range(settings.leader_port_min, settings.leader_port_max + 1)
                    if p not in self.used_ports
                ),
                None,
            )
        return self._port  # type: ignore[return-value]


class Capacity:
    """Free capacity of every node in the snapshot, kept current through one pass."""

    __slots__ = ("classifier", "nodes", "settings")

    def __init__(self, snapshot: Snapshot, now: datetime) -> None:
        self.settings = snapshot.settings
        self.classifier = GPUClassifier(snapshot.settings.gpu_class_patterns)
        self.nodes: dict[NodeId, NodeCapacity] = {
            n.id: NodeCapacity(n, node_is_syncing(n, now, snapshot.settings))
            for n in snapshot.nodes
        }
        # MIG instances by key, to find the parent an instance in use blocks.
        mig = {(n.id, g.key): g for n in snapshot.nodes for g in n.gpus if g.mig}
        for replica in snapshot.replicas:
            for shard in replica.shards:
                cap = self.nodes.get(shard.node_id)
                if cap is None or shard.released:
                    continue
                gpus = {
                    k: mig[(shard.node_id, k)] for k in shard.gpu_keys if (shard.node_id, k) in mig
                }
                self._hold(cap, shard.gpu_keys, gpus, shard.leader_port, shard.threads)
                if replica.state == "active" and replica.deployment_id is not None:
                    cap.deployments[replica.deployment_id] += 1

    @staticmethod
    def _hold(
        cap: NodeCapacity,
        keys: tuple[str, ...],
        gpus: dict[str, GPU],
        port: int | None,
        threads: int,
    ) -> None:
        cap.units_cache.clear()
        cap._port = _UNKNOWN
        for key in keys:
            cap.used_keys.add(key)
            gpu = gpus.get(key)
            if gpu is not None and gpu.mig_parent is not None:
                cap.used_parents.add(gpu.mig_parent)
        if port is not None:
            cap.used_ports.add(port)
        cap.used_threads += threads

    def reserve(
        self,
        node_id: NodeId,
        gpus: tuple[GPU, ...],
        port: int | None,
        threads: int,
        deployment_id: DeploymentId,
    ) -> None:
        cap = self.nodes[node_id]
        self._hold(cap, tuple(g.key for g in gpus), {g.key: g for g in gpus}, port, threads)
        cap.deployments[deployment_id] += 1
