"""plan_adapters: which replicas of its base model should hold each LoRA adapter loaded.

Issue [lora] "Adapters at runtime", step 2. Operators declare adapters on their own (``kind:
adapter``: name, base model, optional ``min_replicas``/``max_replicas``, ``pinned``); each
pass the leader asks ``plan_adapters`` how many and which replicas of the base model should
hold each one, and the agents load and unload at runtime to converge on the per-replica
desired sets. Inputs are plain values: the declarations, the base models' replicas (readiness,
adapter slots, what each holds), each adapter's demand, the state the last call returned and
``now``. Rules, in the order they apply:

Count (how many holders), per adapter, in the autoscaler's shape (``autoscale.decide``):

- up at once: when demand per holder passes a target (``target_requests_per_s`` or
  ``target_concurrency`` per holder, the larger ask wins), the count goes to what demand asks
  for in the same pass: a load costs seconds, a request with no holder waits for one;
- down after a window: only when demand stayed below ``down_fill`` of the targets for
  ``scale_down_window_s`` (the band between is the hysteresis), to the most holders demand
  asked for during that window. A load costs seconds of GPU time and an unload fails nothing,
  so scaling down late is cheap and scaling down early is thrash;
- floor: an explicit ``min_replicas`` holds regardless of demand; a ``pinned`` adapter keeps
  one holder; otherwise one holder stays from the first request until none was seen for
  ``idle_after_s``, then none. The default floor never raises a count from zero: nothing is
  loaded for an adapter nobody asks for, and the first request's load is its wake (held at
  the gateway, it is demand, and up acts at once). The idle rule drops straight to the
  floor without the down window: nothing at all for that long says more than a low rate;
- cap at once: ``max_replicas``, default (and at most) every replica of the base model that is
  not draining and has adapter slots;
- silence is not idleness: demand no gateway reported (``AdapterDemand.known`` false) moves
  nothing but the floor and the cap, and restarts both windows.

Choice (which replicas), per base model, over its ready replicas with slots:

- rendezvous (highest-random-weight) order of (adapter, replica) under blake2b, so adding or
  removing a replica moves few adapters, and every process (a new leader, a test) computes
  the same order: Python's ``hash()`` is salted per process;
- current holders first: a replica holding the adapter keeps it while it ranks within the
  adapter's top ``count + keep_margin``. Why a margin and not pure rendezvous: demand shifts
  change the count, not the choice (a rendezvous top-k sits inside the top-(k+1), so growing
  or shrinking moves exactly the replicas the count adds or drops either way; thrash from
  demand is the count's hysteresis to prevent). What stickiness saves is the fleet's own
  churn: a replica added (an autoscale step, a replacement) or a holder pushed one place down
  by a full replica would otherwise cost a load on one replica and an unload on another for a
  spread no request notices, since every replica of the base model serves the adapter alike.
  A margin of 1 absorbs one such disturbance; a second pushes the holder out and it moves, so
  drift from the rendezvous spread stays bounded and removing a replica still moves only the
  adapters it held. ``keep_margin=0`` is pure rendezvous, for the bench to compare (loads per
  minute against TTFT);
- slots are never exceeded. When they run short, pinned adapters come first, then by demand:
  current holders are kept before anything new is loaded, new holders are taken in priority
  order along each adapter's rendezvous order (skipping full replicas), and only then may an
  adapter still short displace a holder: a pinned one any unpinned holder, an unpinned one a
  holder with ``displace_ratio`` times less demand (so two adapters of similar demand never
  trade a slot back and forth on noise). An adapter that cannot get its count is reported
  with why ("no slots free on the 2 ready replicas of model m");
- replicas that are draining or not ready get nothing new; they keep what they hold
  (unloading from a draining engine fails its requests, and a starting one converges once
  ready) but hold it for nobody: they are not counted as holders.

Output: each replica's desired set, each adapter's count, holders and unplaced reason, the
state to pass to the next call, and the changes with reasons for the action log.

This module must NOT do I/O, read a clock, draw random numbers or call ``hash()``: the shell
passes ``now`` and every input, so property tests drive it exactly as the leader does. It
must NOT order anything by iterating a set (string hashing is salted per process).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

from llmgw.engines.spec import ReplicaId
from llmgw.errors import ConfigError, SpecError

__all__ = [
    "AdapterChange",
    "AdapterDemand",
    "AdapterOutcome",
    "AdapterPlacementConfig",
    "AdapterPlan",
    "AdapterSpec",
    "AdapterState",
    "BaseReplica",
    "ChangeKind",
    "Readiness",
    "plan_adapters",
    "rendezvous_order",
]

# ready: serving and not draining, may take new adapters; starting: not serving yet (or
# unhealthy), counts toward an adapter's default max; draining: leaving, counts toward nothing.
Readiness = Literal["ready", "starting", "draining"]
ChangeKind = Literal["scale", "load", "unload"]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An operator's ``kind: adapter`` declaration (the ``adapters`` table, validated there)."""

    name: str
    # The base model's name (the table's ``model``): only its replicas may hold the adapter.
    model: str
    # None: one holder from its first request until it has seen none for idle_after_s.
    min_replicas: int | None = None
    # None: every replica of the base model that can hold adapters.
    max_replicas: int | None = None
    # Kept loaded on one replica at least, and first in line for slots.
    pinned: bool = False

    def __post_init__(self) -> None:
        lo, hi = self.min_replicas, self.max_replicas
        if (lo is not None and lo < 0) or (hi is not None and hi < 1):
            raise SpecError(
                f"adapter {self.name}: min_replicas {lo} / max_replicas {hi} out of range; "
                "give min_replicas >= 0 and max_replicas >= 1",
                field="min_replicas" if lo is not None and lo < 0 else "max_replicas",
            )
        if lo is not None and hi is not None and hi < lo:
            raise SpecError(
                f"adapter {self.name}: max_replicas {hi} < min_replicas {lo}; raise max_replicas",
                field="max_replicas",
            )


@dataclass(frozen=True, slots=True)
class AdapterDemand:
    """One adapter's demand at this pass, summed over the gateways whose report is fresh.

    The shell derives it from the gateways' demand rows as the autoscaler does, by adapter
    name (clients send the adapter's name as ``model``)."""

    # Gateways whose report was fresh; 0: nothing is known (not the same as no demand).
    gateways: int = 0
    # Requests per second over the last reporting interval (the shell's smoothing).
    requests_per_s: float = 0.0
    # Sent to an engine and not finished.
    in_flight: int = 0
    # Queued at the gateways or engines, held ones (no holder yet) included.
    waiting: int = 0

    @property
    def known(self) -> bool:
        return self.gateways > 0

    @property
    def concurrency(self) -> int:
        return self.in_flight + self.waiting

    @property
    def active(self) -> bool:
        return self.requests_per_s > 0 or self.concurrency > 0


_UNKNOWN = AdapterDemand()


@dataclass(frozen=True, slots=True)
class BaseReplica:
    """One replica of a base model as the adapter placement sees it."""

    replica_id: ReplicaId
    model: str
    # Adapters it may hold at once (vLLM's --max-cpu-loras, else --max-loras, as its profile
    # gives them; a default otherwise): computed by the caller. 0: it serves no adapters.
    slots: int
    readiness: Readiness
    # What the agent reports loaded, plus loads it was told to do and has not reported yet:
    # a load in flight counts as held, so it is not started again somewhere else.
    loaded: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class AdapterState:
    """What one call leaves for the next, per adapter (kept by the leader)."""

    # The count decided last (before replicas ran short: that is reported, not remembered).
    desired: int
    # Since when demand stayed below down_fill of the targets at this count; None: it is not.
    low_since: float | None = None
    # The most holders demand asked for (at down_fill) since low_since: where a down goes.
    low_peak: int = 0
    # Since when no request was seen (known passes only); None: it has demand.
    idle_since: float | None = None


@dataclass(frozen=True, slots=True)
class AdapterPlacementConfig:
    """The knobs, one object for the leader's settings and the bench."""

    # Per holder: past either target the count goes up at once.
    target_requests_per_s: float = 8.0
    target_concurrency: float | None = 16.0
    # Down only to a count that would run at this share of the target or less.
    down_fill: float = 0.8
    scale_down_window_s: float = 300.0
    idle_after_s: float = 600.0
    # A holder ranked below top-count by at most this many places stays (module docstring).
    keep_margin: int = 1
    # An unpinned adapter takes a full replica's slot only from one with this many times less
    # demand.
    displace_ratio: float = 2.0

    def __post_init__(self) -> None:
        tc = self.target_concurrency
        if self.target_requests_per_s <= 0 or (tc is not None and tc <= 0):
            raise ConfigError(
                f"adapter targets {self.target_requests_per_s:g} req/s and {tc} concurrent per "
                "holder must be positive",
                field="target_requests_per_s",
            )
        if not 0 < self.down_fill <= 1:
            raise ConfigError(
                f"down_fill {self.down_fill:g} must be in (0, 1]: above 1 a load at the target "
                "would scale down and straight back up",
                field="down_fill",
            )
        if self.scale_down_window_s < 0 or self.idle_after_s < 0 or self.keep_margin < 0:
            raise ConfigError(
                "scale_down_window_s, idle_after_s and keep_margin must not be negative",
                field="scale_down_window_s",
            )
        if self.displace_ratio < 1:
            raise ConfigError(
                f"displace_ratio {self.displace_ratio:g} must be at least 1: below, two "
                "adapters could take one slot from each other in turn",
                field="displace_ratio",
            )


_DEFAULT_CONFIG = AdapterPlacementConfig()


@dataclass(frozen=True, slots=True)
class AdapterOutcome:
    name: str
    model: str
    # Holders the adapter should have (count after its bounds; what status shows as wanted).
    desired: int
    # The ready replicas chosen to hold it, in its rendezvous order.
    replica_ids: tuple[ReplicaId, ...]
    # Why it has fewer holders than desired, or none at all; "" when it has them.
    unplaced: str = ""


@dataclass(frozen=True, slots=True)
class AdapterChange:
    adapter: str
    kind: ChangeKind
    # The replica loaded or unloaded; None for a count change.
    replica_id: ReplicaId | None
    # The action log's line: "adapter x: 1 -> 2 replicas (demand 14 req/s over 8 per holder)".
    reason: str


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    # Every input replica's desired adapter set, by replica id in order.
    desired_sets: Mapping[ReplicaId, frozenset[str]]
    # Every declared adapter, by name in order.
    adapters: Mapping[str, AdapterOutcome]
    # The next call's state for every declared adapter (a deleted one is forgotten).
    states: Mapping[str, AdapterState]
    # Count changes, then unloads, then loads (an agent frees a slot before it fills one).
    changes: tuple[AdapterChange, ...]


def _score(adapter: str, replica_id: str) -> int:
    # NUL cannot occur in a name (protocol.names), so no two pairs hash the same bytes.
    digest = hashlib.blake2b(
        adapter.encode() + b"\0" + replica_id.encode(), digest_size=8, person=b"llmgw-adapter"
    ).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(adapter: str, replicas: Iterable[BaseReplica]) -> list[BaseReplica]:
    """``replicas`` in ``adapter``'s rendezvous order, best first (ties: by replica id)."""
    return sorted(replicas, key=lambda r: (-_score(adapter, r.replica_id), r.replica_id))


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{round(x, 1):g}"


def _pressure(d: AdapterDemand, cfg: AdapterPlacementConfig) -> float:
    """Demand in holders' worth at the targets: what priority and displacement compare."""
    p = d.requests_per_s / cfg.target_requests_per_s
    if cfg.target_concurrency:
        p = max(p, d.concurrency / cfg.target_concurrency)
    return p


def _need(d: AdapterDemand, cfg: AdapterPlacementConfig, fill: float) -> int:
    # The epsilon keeps 16 req/s at 8 per holder from asking for 3 through float noise.
    n = math.ceil(_pressure(d, cfg) / fill - 1e-9)
    return max(n, 1) if d.active else max(n, 0)


def _demand_text(d: AdapterDemand, cfg: AdapterPlacementConfig) -> tuple[str, str]:
    """The signal that asks for the most holders, and its target per holder."""
    tc = cfg.target_concurrency
    if tc and d.concurrency / tc > d.requests_per_s / cfg.target_requests_per_s:
        return f"{d.concurrency} concurrent requests", _num(tc)
    return f"demand {_num(d.requests_per_s)} req/s", _num(cfg.target_requests_per_s)


def _decide_count(
    spec: AdapterSpec,
    dem: AdapterDemand,
    prev: AdapterState,
    cap: int,
    cap_why: str,
    cfg: AdapterPlacementConfig,
    now: float,
) -> tuple[AdapterState, str]:
    """The adapter's count and state at ``now``, and why it changed ("" when it did not)."""
    d0 = prev.desired
    if spec.min_replicas is not None and (spec.min_replicas >= 1 or not spec.pinned):
        floor, floor_why = spec.min_replicas, f"min_replicas {spec.min_replicas}"
    elif spec.pinned:  # pinned is one holder at least, whatever min_replicas says
        floor, floor_why = 1, "pinned"
    else:
        # The default floor holds one holder; it never raises the count from zero, so nothing
        # is loaded for an adapter nobody asks for (and a reload needs a request).
        floor, floor_why = min(d0, 1), ""
    if not dem.known:
        # Nothing is known of this moment: hold, and make both windows start over, so a gap
        # in the reports never reads as a quiet spell.
        d, why = max(d0, floor), floor_why
        if d > cap:
            d, why = cap, cap_why
        return AdapterState(d), why if d != d0 else ""

    idle_since = None if dem.active else (prev.idle_since if prev.idle_since is not None else now)
    idle_for = 0.0 if idle_since is None else now - idle_since
    idle = idle_since is not None and idle_for >= cfg.idle_after_s
    if idle and spec.min_replicas is None and not spec.pinned:
        floor = 0
    up = _need(dem, cfg, 1.0)
    down = _need(dem, cfg, cfg.down_fill)
    d, why = d0, ""
    low_since: float | None = None
    low_peak = 0
    if max(up, floor) > d0:
        d = max(up, floor)
        if up >= floor:
            what, target = _demand_text(dem, cfg)
            why = f"{what} and no holder" if d0 == 0 else f"{what} over {target} per holder"
        else:
            why = floor_why
    elif idle and d0 > floor:
        d, why = floor, f"idle for {idle_for:.0f} s"
    elif down < d0 and d0 > floor:
        low_since = prev.low_since if prev.low_since is not None else now
        low_peak = max(prev.low_peak, down) if prev.low_since is not None else down
        if now - low_since >= cfg.scale_down_window_s and max(low_peak, floor) < d0:
            d = max(low_peak, floor)
            what, target = _demand_text(dem, cfg)
            why = (
                f"{what} under {cfg.down_fill:.0%} of {target} per holder for "
                f"{cfg.scale_down_window_s:g} s"
            )
    if d > cap:
        d = cap
        if d < d0:
            why = cap_why
    if d == d0:
        return AdapterState(d, low_since, low_peak, idle_since), ""
    # A move closes the low window and opens the next one from the new count, at once if
    # demand is already below it (so planning the same moment again is a no-op).
    if down < d and d > floor:
        return AdapterState(d, now, down, idle_since), why
    return AdapterState(d, idle_since=idle_since), why


@dataclass(slots=True)
class _Slots:
    """The holders chosen so far on one ready replica: what the slot rule counts."""

    replica: BaseReplica
    held: list[str]

    @property
    def free(self) -> int:
        return self.replica.slots - len(self.held)


@dataclass(slots=True)
class _Choice:
    spec: AdapterSpec
    demand: AdapterDemand
    pressure: float
    count: int
    order: list[BaseReplica]  # ready replicas with slots, rendezvous order
    chosen: list[ReplicaId]

    @property
    def short(self) -> bool:
        return len(self.chosen) < self.count


def _may_displace(a: _Choice, b: _Choice, cfg: AdapterPlacementConfig) -> bool:
    if b.spec.pinned or a is b:
        return False
    if a.spec.pinned:
        return True
    # Unknown demand is never a reason to take or lose a slot: a gateway's silence would
    # otherwise move adapters.
    if not (a.demand.known and b.demand.known):
        return False
    return a.pressure > cfg.displace_ratio * b.pressure


def _place_model(
    choices: list[_Choice],
    ready: list[BaseReplica],
    cfg: AdapterPlacementConfig,
    why_unload: dict[tuple[str, ReplicaId], str],
    why_load: dict[tuple[str, ReplicaId], str],
) -> None:
    """Choose holders for one base model's adapters (``choices`` in priority order)."""
    slots = {r.replica_id: _Slots(r, []) for r in ready}

    def take(c: _Choice, rid: ReplicaId) -> None:
        c.chosen.append(rid)
        slots[rid].held.append(c.spec.name)

    # 1. Keep current holders within the margin, in priority order: when slots shrank (a
    # profile edit), the adapters ahead keep theirs.
    for c in choices:
        reach = c.count + cfg.keep_margin
        for i, r in enumerate(c.order):
            if i >= reach or len(c.chosen) >= c.count:
                break
            if c.spec.name not in r.loaded:
                continue
            if slots[r.replica_id].free > 0:
                take(c, r.replica_id)
            else:
                why_unload[(c.spec.name, r.replica_id)] = (
                    f"{r.replica_id} has {r.slots} slots, taken by adapters ahead of it"
                )
    # 2. New holders in free slots, in priority order along each rendezvous order.
    for c in choices:
        for r in c.order:
            if not c.short:
                break
            if r.replica_id not in c.chosen and slots[r.replica_id].free > 0:
                take(c, r.replica_id)
    # 3. Still short: take a slot from a holder that yields to this adapter. A displaced
    # adapter comes later in priority order, so it gets its own turn below, and a chain of
    # displacements ends (each step goes to a strictly colder or unpinned adapter).
    by_name = {c.spec.name: c for c in choices}
    rank = {c.spec.name: i for i, c in enumerate(choices)}
    for c in choices:
        for r in c.order:
            if not c.short:
                break
            rid = r.replica_id
            if rid in c.chosen:
                continue
            if slots[rid].free > 0:
                take(c, rid)
                continue
            victims = [by_name[n] for n in slots[rid].held if _may_displace(c, by_name[n], cfg)]
            if not victims:
                continue
            v = max(victims, key=lambda x: rank[x.spec.name])  # the last in priority order
            v.chosen.remove(rid)
            slots[rid].held.remove(v.spec.name)
            take(c, rid)
            why = "pinned" if c.spec.pinned else _demand_text(c.demand, cfg)[0]
            why_unload[(v.spec.name, rid)] = f"displaced by {c.spec.name}, {why}"
            why_load[(c.spec.name, rid)] = f"displacing {v.spec.name}"


def _shortfall(spec: AdapterSpec, desired: int, placed: int, pool: Sequence[BaseReplica]) -> str:
    """Why the adapter has fewer holders than it should, for status; "" when it has them."""
    m = spec.model
    cap = sum(1 for r in pool if r.readiness != "draining" and r.slots > 0)
    if not pool:
        return f"model {m} has no replicas"
    live = [r for r in pool if r.readiness != "draining"]
    if not live:
        return f"every replica of model {m} is draining"
    if cap == 0:
        return f"the {len(live)} replicas of model {m} have no adapter slots"
    ready = sum(1 for r in live if r.readiness == "ready" and r.slots > 0)
    if placed < min(desired, ready):
        return f"no slots free on the {ready} ready replicas of model {m}"
    if placed < desired and ready == 0:
        return f"none of the {_plural(cap)} of model {m} that can hold it is ready"
    if placed < desired:
        return f"only {ready} of the {cap} replicas of model {m} that can hold it are ready"
    if spec.min_replicas is not None and spec.min_replicas > cap:
        return f"min_replicas {spec.min_replicas} but only {cap} replicas of model {m} can hold it"
    return ""


def _plural(n: int, noun: str = "replica") -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def plan_adapters(
    adapters: Iterable[AdapterSpec],
    replicas: Iterable[BaseReplica],
    *,
    demand: Mapping[str, AdapterDemand],
    states: Mapping[str, AdapterState],
    now: float,
    config: AdapterPlacementConfig = _DEFAULT_CONFIG,
) -> AdapterPlan:
    """Every adapter's count and holders and every replica's desired set at ``now``.

    ``demand``: by adapter name; a missing one is unknown, not idle. ``states``: the last
    call's ``AdapterPlan.states``; an adapter missing from it (newly declared, or a new leader
    whose memory starts empty) starts from the ready replicas holding it now, so a leader
    change unloads nothing before a window has passed. ``now``: seconds on the clock that
    ``states`` was written with."""
    cfg = config
    specs = sorted(adapters, key=lambda s: s.name)
    reps = sorted(replicas, key=lambda r: r.replica_id)
    # Sorted first, so a duplicate sits next to its twin; unique names are what the adapters
    # and replicas tables guarantee, and a mapping by name would silently keep one of two.
    for what, names in (
        ("adapter", [s.name for s in specs]),
        ("replica", [str(r.replica_id) for r in reps]),
    ):
        dup = next((a for a, b in pairwise(names) if a == b), None)
        if dup is not None:
            raise ConfigError(f"{what} {dup} is given twice; give each once")
    by_name = {s.name: s for s in specs}
    pools: dict[str, list[BaseReplica]] = {}
    for r in reps:
        pools.setdefault(r.model, []).append(r)

    new_states: dict[str, AdapterState] = {}
    choices: dict[str, _Choice] = {}
    changes: list[AdapterChange] = []
    for s in specs:
        pool = pools.get(s.model, [])
        holdable = [r for r in pool if r.readiness != "draining" and r.slots > 0]
        ready = [r for r in holdable if r.readiness == "ready"]
        cap = len(holdable) if s.max_replicas is None else min(s.max_replicas, len(holdable))
        if s.max_replicas is not None and s.max_replicas <= len(holdable):
            cap_why = f"max_replicas {s.max_replicas}"
        else:
            cap_why = f"{_plural(cap)} of model {s.model} can hold it"
        dem = demand.get(s.name, _UNKNOWN)
        prev = states.get(s.name)
        if prev is None:
            prev = AdapterState(sum(1 for r in ready if s.name in r.loaded))
        st, why = _decide_count(s, dem, prev, cap, cap_why, cfg, now)
        new_states[s.name] = st
        if why:
            line = f"adapter {s.name}: {prev.desired} -> {st.desired} replicas ({why})"
            changes.append(AdapterChange(s.name, "scale", None, line))
        choices[s.name] = _Choice(
            s, dem, _pressure(dem, cfg), st.desired, rendezvous_order(s.name, ready), []
        )

    why_unload: dict[tuple[str, ReplicaId], str] = {}
    why_load: dict[tuple[str, ReplicaId], str] = {}
    priority: dict[str, list[_Choice]] = {}
    for c in sorted(choices.values(), key=lambda c: (not c.spec.pinned, -c.pressure, c.spec.name)):
        priority.setdefault(c.spec.model, []).append(c)
    for model, group in priority.items():
        ready_all = [r for r in pools.get(model, []) if r.readiness == "ready" and r.slots > 0]
        _place_model(group, ready_all, cfg, why_unload, why_load)

    desired_sets: dict[ReplicaId, frozenset[str]] = {}
    for r in reps:
        if r.readiness == "ready":
            held = [c.spec.name for c in priority.get(r.model, []) if r.replica_id in c.chosen]
        else:
            # Kept, not counted: see the module docstring. Still within its slots.
            mine = [c.spec.name for c in priority.get(r.model, []) if c.spec.name in r.loaded]
            held = mine[: max(r.slots, 0)]
        desired_sets[r.replica_id] = frozenset(held)

    unloads: list[AdapterChange] = []
    loads: list[AdapterChange] = []
    for r in reps:
        want = desired_sets[r.replica_id]
        for a in sorted(r.loaded - want):
            spec = by_name.get(a)
            if spec is None:
                why = "no longer declared"
            elif spec.model != r.model:
                why = f"declared for model {spec.model}, not {r.model}"
            elif (a, r.replica_id) in why_unload:
                why = why_unload[(a, r.replica_id)]
            elif r.readiness != "ready":
                why = f"{r.replica_id} is {r.readiness} and has {r.slots} slots"
            elif choices[a].count == 0:
                why = "wanted on no replica"
            else:
                why = f"not one of its {_plural(choices[a].count, 'holder')}"
            line = f"adapter {a}: unload from {r.replica_id} ({why})"
            unloads.append(AdapterChange(a, "unload", r.replica_id, line))
        for a in sorted(want - r.loaded):
            why = why_load.get((a, r.replica_id), f"to hold it on {_plural(choices[a].count)}")
            line = f"adapter {a}: load on {r.replica_id} ({why})"
            loads.append(AdapterChange(a, "load", r.replica_id, line))

    outcomes: dict[str, AdapterOutcome] = {}
    for s in specs:
        c = choices[s.name]
        chosen = [r.replica_id for r in c.order if r.replica_id in c.chosen]
        why = _shortfall(s, c.count, len(chosen), pools.get(s.model, []))
        outcomes[s.name] = AdapterOutcome(s.name, s.model, c.count, tuple(chosen), why)
    return AdapterPlan(desired_sets, outcomes, new_states, (*changes, *unloads, *loads))
