"""Where one replica goes, or a reason a person can act on when it goes nowhere.

Placement is a chain of small filters, each returning the nodes that survive
and why the others were dropped (that answers "why is my replica pending?"),
then a score for the survivors. The rules (docs/architecture.md §4, engines package):

- a replica needs `nodes × gpus_per_node` free GPUs of its class, all of one
  GPU name (a tensor-parallel group runs at the pace of its slowest GPU); CPU
  engines need threads instead;
- a multi-node replica sits within one fabric (IB/RoCE or an `nvl:` NVLink
  domain: NCCL across fabrics hangs rather than failing) and, for
  TensorRT-LLM's mpirun, on the same GPU indices and HCA names on every node;
- MIG instances only for single-GPU profiles, and never an instance together
  with its parent GPU;
- simulated GPUs only for the `sim` engine;
- cordoned, draining, unapproved and not-syncing nodes get nothing; the pool
  must match; rank 0 gets a leader port from the node's range.

Scoring: avoid nodes the caller names (a crash loop's), spread a deployment's
replicas across nodes, then prefer nodes already in use and the tightest fit,
so whole nodes stay free for large profiles. Pure: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.errors import PlacementError
from llmgw.planner.capacity import Capacity, NodeCapacity
from llmgw.planner.snapshot import (
    GPU,
    DeploymentId,
    FabricName,
    NodeId,
    PlacementRequirements,
)

__all__ = [
    "NodeAssignment",
    "Placement",
    "PlacementRequest",
    "Unplaceable",
    "place_replica",
]

# Node names listed per reason in a one-line explanation; the full map is on the error.
_NAMES_PER_REASON = 5


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    deployment_id: DeploymentId
    pool: str
    gpu_class: str
    engine: str
    requirements: PlacementRequirements
    # Nodes to use only when nothing else fits (where a replica just crash-looped).
    avoid_nodes: frozenset[NodeId] = frozenset()
    # Derived from requirements once: read for every node of every placement.
    per_node: int = field(init=False)
    threads: int = field(init=False)
    num_nodes: int = field(init=False)
    mig_ok: bool = field(init=False)

    def __post_init__(self) -> None:
        r = self.requirements
        per_node = 0 if r.cpu_only else max(r.gpus_per_node, 1)
        object.__setattr__(self, "per_node", per_node)
        object.__setattr__(self, "threads", max(r.threads, 1))
        object.__setattr__(self, "num_nodes", max(r.nodes, 1))
        # MIG instances have no P2P: only a one-GPU, one-node replica may use one.
        object.__setattr__(self, "mig_ok", r.mig_allowed and per_node == 1 and r.nodes <= 1)


@dataclass(frozen=True, slots=True)
class NodeAssignment:
    node_id: NodeId
    gpus: tuple[GPU, ...]
    hcas: tuple[str, ...]
    fabric: str
    leader_port: int | None
    threads: int


@dataclass(frozen=True, slots=True)
class Placement:
    # In rank order: the first is rank 0, the leader.
    assignments: tuple[NodeAssignment, ...]


@dataclass(frozen=True, slots=True)
class Unplaceable:
    # What is needed and the closest the fleet comes, in one sentence.
    summary: str
    # (node name, why it could not take the replica), in node order.
    node_reasons: tuple[tuple[str, str], ...]

    def explain(self) -> str:
        """The summary plus nodes grouped by reason, short enough for a status line."""
        groups: dict[str, list[str]] = defaultdict(list)
        for name, why in self.node_reasons:
            groups[why].append(name)
        parts = []
        for why, names in groups.items():
            shown = ", ".join(names[:_NAMES_PER_REASON])
            more = len(names) - _NAMES_PER_REASON
            parts.append(f"{shown}{f' (+{more} more)' if more > 0 else ''}: {why}")
        return self.summary + ("; " + "; ".join(parts) if parts else "")

    def error(self) -> PlacementError:
        return PlacementError(self.explain(), reasons=dict(self.node_reasons))


# A filter: (request, node, capacity) -> why the node cannot take the replica, or
# None. Filters run in order and the first reason is the node's; a node with no
# reason survives to scoring. One loop over nodes per replica, not one per filter.
_Filter = Callable[[PlacementRequest, NodeCapacity, Capacity], str | None]


def _schedulable(req: PlacementRequest, n: NodeCapacity, cap: Capacity) -> str | None:
    node = n.node
    if not node.approved:
        return f"pending approval (llmgw nodes approve {node.name})"
    if node.draining:
        return "draining"
    if node.cordoned:
        return "cordoned"
    if not n.syncing:
        return "not syncing" if node.last_sync_at else "never synced"
    return None


def _in_pool(req: PlacementRequest, n: NodeCapacity, cap: Capacity) -> str | None:
    return None if n.node.pool == req.pool else f"in pool {n.node.pool}, not {req.pool}"


def _leader_port(req: PlacementRequest, n: NodeCapacity, cap: Capacity) -> str | None:
    # Any chosen node may become rank 0, so each needs a free port; a full range
    # means hundreds of live shards on one node, which no real node holds.
    s = cap.settings
    if n.free_port(s) is None:
        return f"no free leader port in {s.leader_port_min}-{s.leader_port_max}"
    return None


def _free_units(req: PlacementRequest, n: NodeCapacity, cap: Capacity) -> dict[str, list[GPU]]:
    """Free GPUs this request may use on the node, by GPU name, MIG instances first
    (an instance leaves whole GPUs to larger profiles), then by index.

    Cached per node until the node's next reservation: a pass asks the same
    question of every node for every replica it places."""
    mig_ok = req.mig_ok
    key = (req.gpu_class, req.engine, mig_ok)
    hit = n.units_cache.get(key)
    if hit is not None:
        return hit
    groups: dict[str, list[GPU]] = defaultdict(list)
    for gpu in n.gpus_in_order:
        if n.gpu_free(gpu) and cap.classifier.usable(gpu, req.gpu_class, req.engine, mig_ok):
            groups[gpu.name].append(gpu)
    n.units_cache[key] = groups
    return groups


def _has_room(req: PlacementRequest, n: NodeCapacity, cap: Capacity) -> str | None:
    if req.requirements.cpu_only:
        free = n.free_threads()
        return None if free >= req.threads else f"{free} free CPU threads, needs {req.threads}"
    groups = _free_units(req, n, cap)
    most = max((len(g) for g in groups.values()), default=0)
    if most >= req.per_node:
        return None
    if not any(cap.classifier.usable(g, req.gpu_class, req.engine, True) for g in n.node.gpus):
        sim_only = n.node.gpus and all(cap.classifier.is_sim(g.name) for g in n.node.gpus)
        return "simulated GPUs run only the sim engine" if sim_only else f"no {req.gpu_class} GPUs"
    return f"{most} free {req.gpu_class} GPUs, needs {req.per_node}"


_NODE_FILTERS: tuple[_Filter, ...] = (_schedulable, _in_pool, _leader_port, _has_room)


def _score(req: PlacementRequest, n: NodeCapacity, leftover: int) -> tuple[int, int, int, int, str]:
    """Lower is better: avoided, replicas of this deployment here, untouched node, leftover."""
    return (
        int(n.node.id in req.avoid_nodes),
        n.deployments[req.deployment_id],
        int(n.untouched()),
        leftover,
        n.node.name,
    )


def _pick_gpus(req: PlacementRequest, n: NodeCapacity, cap: Capacity) -> tuple[GPU, ...] | None:
    """MIG instances before whole GPUs, then the tightest single-name group, lowest indices first."""
    fitting = [g for g in _free_units(req, n, cap).values() if len(g) >= req.per_node]
    if not fitting:
        return None
    best = min(fitting, key=lambda g: (not g[0].mig, len(g), g[0].name))
    return tuple(best[: req.per_node])


def _assign(
    req: PlacementRequest, n: NodeCapacity, cap: Capacity, gpus: tuple[GPU, ...], rank: int,
    fabric: FabricName | None,
) -> NodeAssignment:  # fmt: skip
    port = n.free_port(cap.settings) if rank == 0 else None
    hcas: tuple[str, ...] = ()
    if fabric is not None:
        hcas = next(f.hcas for f in n.node.fabrics if f.name == fabric)
    threads = req.threads if req.requirements.cpu_only else 0
    return NodeAssignment(n.node.id, gpus, hcas, fabric or "", port, threads)


def _run_filters(
    req: PlacementRequest, cap: Capacity
) -> tuple[list[NodeCapacity], list[tuple[str, str]]]:
    """(nodes that pass every filter, [(node name, first reason it failed)] in node order)."""
    survivors: list[NodeCapacity] = []
    reasons: list[tuple[str, str]] = []
    for n in cap.nodes.values():
        for f in _NODE_FILTERS:
            why = f(req, n, cap)
            if why is not None:
                reasons.append((n.node.name, why))
                break
        else:
            survivors.append(n)
    return survivors, reasons


def _needs(req: PlacementRequest) -> str:
    if req.requirements.cpu_only:
        return f"{req.threads} free CPU threads"
    return f"{req.per_node} free {req.gpu_class} GPU{'s' if req.per_node != 1 else ''}"


def _place_single(req: PlacementRequest, cap: Capacity) -> Placement | Unplaceable:
    survivors, reasons = _run_filters(req, cap)
    # Every survivor has room (_has_room); GPUs are picked only on the winner.
    best: tuple[tuple[int, int, int, int, str], NodeCapacity] | None = None
    for n in survivors:
        if req.requirements.cpu_only:
            leftover = n.free_threads() - req.threads
        else:
            leftover = sum(len(g) for g in _free_units(req, n, cap).values()) - req.per_node
        key = _score(req, n, leftover)
        if best is None or key < best[0]:
            best = (key, n)
    if best is None:
        summary = f"needs 1 node with {_needs(req)} in pool {req.pool}; no node has them"
        return Unplaceable(summary, tuple(reasons))
    n = best[1]
    gpus = () if req.requirements.cpu_only else _pick_gpus(req, n, cap)
    if gpus is None:  # _has_room keeps only nodes with room; this would be a bug there
        raise RuntimeError(f"placement: node {n.node.name} passed the room filter without room")
    a = _assign(req, n, cap, gpus, 0, None)
    cap.reserve(n.node.id, a.gpus, a.leader_port, a.threads, req.deployment_id)
    return Placement((a,))


def _place_multi(req: PlacementRequest, cap: Capacity) -> Placement | Unplaceable:
    survivors, reasons = _run_filters(req, cap)
    rq = req.requirements
    # (fabric, GPU name, HCA names when they must match) -> nodes with their free GPUs.
    groups: dict[tuple[str, str, tuple[str, ...]], list[tuple[NodeCapacity, list[GPU]]]] = (
        defaultdict(list)
    )
    per_fabric: dict[str, int] = defaultdict(int)
    for n in survivors:
        if not n.node.fabrics:
            reasons.append(
                (n.node.name, "no fabric (multi-node replicas need InfiniBand, RoCE or NVLink)")
            )
            continue
        units = _free_units(req, n, cap)
        for f in n.node.fabrics:
            per_fabric[f.name] += 1
            hcas = f.hcas if rq.same_hcas_across_nodes else ()
            for name, free_gpus in units.items():
                if len(free_gpus) >= req.per_node:
                    groups[(f.name, name, hcas)].append((n, free_gpus))
    choices: list[tuple[tuple[int, ...], str, list[tuple[NodeCapacity, tuple[GPU, ...]]]]] = []
    for (fabric, _name, _hcas), members in sorted(groups.items()):
        chosen = _choose_nodes(req, members)
        if chosen is not None:
            # Sum each score component over the chosen nodes; the tightest fabric wins ties.
            free = {n.node.id: len(g) for n, g in members}
            keys = [_score(req, n, free[n.node.id] - req.per_node) for n, _ in chosen]
            total = tuple(sum(k[i] for k in keys) for i in range(4))  # type: ignore[misc]
            choices.append((total, fabric, chosen))
    if not choices:
        order = {n.node.name: i for i, n in enumerate(cap.nodes.values())}
        reasons.sort(key=lambda nr: order[nr[0]])
        return Unplaceable(_multi_summary(req, groups, per_fabric), tuple(reasons))
    _, fabric, chosen = min(choices, key=lambda c: (c[0], c[1]))
    assignments = []
    for rank, (n, picked) in enumerate(chosen):
        a = _assign(req, n, cap, picked, rank, FabricName(fabric))
        cap.reserve(n.node.id, a.gpus, a.leader_port, a.threads, req.deployment_id)
        assignments.append(a)
    return Placement(tuple(assignments))


def _choose_nodes(
    req: PlacementRequest, members: list[tuple[NodeCapacity, list[GPU]]]
) -> list[tuple[NodeCapacity, tuple[GPU, ...]]] | None:
    k = req.per_node
    ranked = sorted(members, key=lambda m: _score(req, m[0], len(m[1]) - k))
    if not req.requirements.same_gpu_indices_across_nodes:
        if len(ranked) < req.num_nodes:
            return None
        return [(n, tuple(g[:k])) for n, g in ranked[: req.num_nodes]]
    # mpirun gives every rank one CUDA_VISIBLE_DEVICES: try each node's lowest
    # free index set and keep the first (best-ranked) that enough nodes share.
    tried: set[tuple[int, ...]] = set()
    for _, gpus in ranked:
        wanted = tuple(g.index for g in gpus[:k])
        # Most nodes share a few free patterns: try each once, or a big fabric is O(n²).
        if wanted in tried:
            continue
        tried.add(wanted)
        fits = []
        for n, g in ranked:
            by_index = {x.index: x for x in g}
            if all(i in by_index for i in wanted):
                fits.append((n, tuple(by_index[i] for i in wanted)))
        if len(fits) >= req.num_nodes:
            return fits[: req.num_nodes]
    return None


def _multi_summary(
    req: PlacementRequest,
    groups: dict[tuple[str, str, tuple[str, ...]], list[tuple[NodeCapacity, list[GPU]]]],
    per_fabric: dict[str, int],
) -> str:
    extra = []
    if req.requirements.same_gpu_indices_across_nodes:
        extra.append("the same GPU indices")
    if req.requirements.same_hcas_across_nodes:
        extra.append("the same HCAs")
    also = f" with {' and '.join(extra)} on every node" if extra else ""
    head = (
        f"needs {req.num_nodes} nodes × {req.per_node} {req.gpu_class} GPUs in one fabric"
        f"{also} in pool {req.pool}"
    )
    if not per_fabric:
        return f"{head}; no schedulable node with room is on a fabric"
    parts = []
    for fabric in sorted(per_fabric):
        by_name: dict[str, int] = defaultdict(int)
        for (f, name, _), members in groups.items():
            if f == fabric:
                by_name[name] = max(by_name[name], len(members))
        best = max(by_name.values(), default=0)
        part = f"fabric {fabric} has {best} node{'s' if best != 1 else ''} with {req.per_node} free"
        if len(by_name) > 1:
            # Enough nodes in total, but a replica runs on one GPU model only.
            models = ", ".join(f"{k} with {n}" for n, k in sorted(by_name.items()))
            part += f" of one GPU model ({models})"
        parts.append(part)
    return f"{head}; " + "; ".join(parts)


def place_replica(req: PlacementRequest, cap: Capacity) -> Placement | Unplaceable:
    """Place one replica and reserve what it uses in `cap`, or say why it cannot go anywhere."""
    if req.num_nodes == 1:
        return _place_single(req, cap)
    return _place_multi(req, cap)
