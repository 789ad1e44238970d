"""The gateway's route table: which replicas serve which model name, cached in memory.

Three statements (``store.routes``) read every live rank-0 shard with its replica's state, its
launch spec's profile and its runtime adapters, every deployment's names, and every declared
adapter; ``build_table`` (pure) turns the rows into a name -> ``ModelRoute`` map: the served
model name and every LoRA adapter name (adapters route to replicas of the base model that load
them; models and adapters share one namespace, and a name claimed by both routes as the model).
A profile's static adapters route to every ready replica launched with them; a declared adapter
(``kind: adapter``, loaded at runtime where the leader places it) only to the ready replicas
whose engine reports it loaded (``runtime_adapters``), and with none, requests wait in flow
control while it is placed and loaded (issue [lora]).
A replica is *ready* (the statement decides) when it is active (not draining or stopping), its
shard is desired running, its agent reports the shard ready and gives a proxy URL. Names of deployments whose
replicas are all unready (or that have none: scaled to zero, all replaced in a rollout) stay in
the table, so a client gets 503 (retry) instead of 404 (wrong name).
Each replica's admission ceiling, each name's ``tokenizer_none`` (a profile serving it says
``tokenizer: none``) and each name's ``apis`` (the API families the profiles serving it serve)
are the profiles' live values, so an edit reaches the gateways within seconds without a roll.

``RouteCache`` re-reads every ``refresh_s`` and at once on a NOTIFY of the desired-state
channel (a drain, a new deployment), through the process's ``NotifyHub`` (``notified``).
When Postgres is down it keeps the last table: the gateway serves from it (fail static), and
passive health ejects replicas that died meanwhile.

What it must NOT do: hand the engine keys to anything but the upstream client (they are
``repr=False`` and never logged).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.engines import ANY_ENGINE_LOAD_METRICS, API_GENERATE, LoadMetrics
from llmgw.gateway.notified import NotifiedCache
from llmgw.gateway.routing.router import HashParams
from llmgw.gateway.runtime_adapters import AdapterBlocked, adapter_blocked, loaded_adapters
from llmgw.kv.hashing import ExtraKeyFormat
from llmgw.logs import get_logger
from llmgw.store.catalog import CHANGE_CHANNEL, ROUTES_CHANNEL
from llmgw.store.notify import NotifyHub
from llmgw.store.routes import (
    AdapterRow,
    DeclaredRow,
    RouteRow,
    read_adapters,
    read_declared,
    read_routes,
)

__all__ = [
    "UNKNOWN_APIS",
    # The rows build_table takes, read by store.routes.
    "AdapterRow",
    "DeclaredRow",
    "Endpoint",
    "ModelRoute",
    "RouteCache",
    "RouteRow",
    "RouteTable",
    "build_table",
]

log = get_logger("llmgw.gateway")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One replica as the gateway reaches it: through its rank-0 shard's agent proxy."""

    replica: str
    shard: str
    url: str  # the agent's proxy for the shard: http://<mgmt>:<port>/shards/<shard>
    api_key: str = field(repr=False)  # shards.engine_api_key: the proxy demands it
    index_model: str  # the name the KV index files this shard's blocks under
    hash: HashParams | None  # None: the profile has no kv_events, precise routing impossible
    # LoRA name -> path, as the engine was given them: its profile's static adapters and the
    # declared ones its agent reports loaded (the declared path, which the agent loads from).
    adapters: Mapping[str, str]
    # The engine process behind it (boot id, pid, start time): a new one has an empty KV cache.
    incarnation: str = ""
    # Admission ceiling: requests running plus waiting it takes from all gateways together.
    max_in_flight: int = 1 << 20
    # Where its engine's /metrics reports running and waiting requests (the engine's adapter
    # says, ``store.routes``): the load scrape reads these names, no others.
    load_metrics: LoadMetrics = ANY_ENGINE_LOAD_METRICS


# The API families of a name no row says anything about (every profile serving it unreadable):
# generation, what every engine serves by default and all the gateway served before families.
UNKNOWN_APIS: frozenset[str] = frozenset({API_GENERATE})


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str  # what clients send as "model" (and what the engine answers to)
    base: str  # the served model name the adapter belongs to (== name for a model)
    lora: tuple[str, str] | None  # (adapter name, path) for an adapter name
    endpoints: tuple[Endpoint, ...]  # ready replicas only; empty: 503 (or held, below)
    # An autoscaled deployment serves the name: with no ready replica a request waits in the
    # queue while its demand wakes one (scale from zero), instead of an immediate 503.
    wakeable: bool = False
    # A profile serving the name (a deployment's, or one a live replica was launched from)
    # says `tokenizer: none`: the gateway never tokenizes its prompts itself, whatever files
    # are stored for it (a replica's /tokenize, then the approximate tree).
    tokenizer_none: bool = False
    # Why a wake of this name cannot succeed, as the leader knows it (``wake_blocked``); "":
    # nothing known against it. Held requests are answered with it (flow control).
    wake_blocked: str = ""
    # The API families (``llmgw.engines.API_GROUPS``) the name is served for: the union over
    # the profiles serving it (each live replica's launching profile and each deployment's),
    # an adapter its base model's. A request of another family gets a 404 naming the routes
    # these serve, before it waits for or reaches any replica.
    apis: frozenset[str] = UNKNOWN_APIS
    # A declared adapter (``kind: adapter``) the leader places and agents load at runtime:
    # ``endpoints`` are the base's ready replicas whose engine reports it loaded, and with
    # none a request is held (``wakeable``) while it is placed and loaded.
    runtime: bool = False
    # Why the runtime adapter will not load while a request waits (its load failed on every
    # replica the leader chose; no profile of its base has adapter slots): held requests are
    # answered with it at once, new ones refused (flow control). None: nothing against it.
    adapter_blocked: AdapterBlocked | None = None


@dataclass(frozen=True, slots=True)
class RouteTable:
    routes: Mapping[str, ModelRoute]
    read_at: float  # time.monotonic() of the read; 0.0: never read
    # Every adapter name (static and declared) -> its base model's route name: what a 404's
    # hint lists (``runtime_adapters.unknown_model_hint``).
    adapters: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str) -> ModelRoute | None:
        return self.routes.get(name)


def _hash_params(profile: Mapping[str, Any]) -> HashParams | None:
    if not profile.get("kv_events"):
        return None
    kv = profile.get("kv_hash") or {}
    raw_fmt = kv.get("extra_key_format") or "tagged"
    if raw_fmt not in ("tagged", "legacy"):
        return None
    fmt: ExtraKeyFormat = "legacy" if raw_fmt == "legacy" else "tagged"
    try:
        block_size = int(kv.get("block_size") or 16)
    except (TypeError, ValueError):
        return None
    seed = kv.get("seed") or None
    return HashParams(seed=str(seed) if seed is not None else None, block_size=block_size,
                      extra_key_format=fmt)  # fmt: skip


def served_name(profile: Mapping[str, Any], index_model: str) -> str:
    return str(
        profile.get("served_model_name")
        or profile.get("model")
        or index_model
        or profile.get("model_path")
        or ""
    )


# The rollout status's words for a replica the placement cannot fit (``planner.status``), and
# for the cases among them that free themselves within a queue's wait (GPUs held by draining
# or stopping replicas).
_UNPLACEABLE = "cannot place a replica: "
_FREEING = "replicas to free their GPUs"
_REASON_CHARS = 400


def wake_blocked(d: DeclaredRow) -> str:
    """Pure: why a wake of ``d`` cannot succeed now, as the leader's rows say ("": nothing
    known). An engine that crash-loops, or a replica no node can take (no node with its GPU
    class, every GPU taken) does not resolve itself while a request waits; a placement
    waiting on draining or stopping replicas does, so it blocks nothing."""
    if d.crash_reason is not None:
        return f"its engine is crash-looping ({d.crash_reason.strip()[:_REASON_CHARS]})"
    at = d.status_reason.find(_UNPLACEABLE)
    if at >= 0 and _FREEING not in d.status_reason:
        why = d.status_reason[at + len(_UNPLACEABLE) :]
        return f"the leader cannot place a replica ({why[:_REASON_CHARS]})"
    return ""


def build_table(
    rows: Iterable[RouteRow],
    *,
    read_at: float,
    declared: Iterable[DeclaredRow] = (),
    adapters: Iterable[AdapterRow] = (),
) -> RouteTable:
    """Pure: the rows of ``store.routes.read_routes`` (with ``read_declared`` and
    ``read_adapters``) -> the table."""
    rows = list(rows)
    declared = list(declared)
    runtime = {a.name: a for a in adapters}
    models: dict[str, list[Endpoint]] = {}
    statics: dict[str, tuple[str, str, list[Endpoint]]] = {}
    wakeable: set[str] = set()
    no_local: set[str] = set()  # names a profile serving them says `tokenizer: none` for
    blocked: dict[str, str] = {}  # name -> why its wake cannot succeed
    served: dict[str, set[str]] = {}  # served name -> the API families its profiles serve
    of_model: dict[str, set[str]] = {}  # model -> the served names its replicas answer to
    slots: set[str] = set()  # served names a profile with adapter slots serves
    for d in declared:
        models.setdefault(d.name, [])
        served.setdefault(d.name, set()).update(d.apis)
        of_model.setdefault(d.model or d.name, set()).add(d.name)
        if d.adapter_slots > 0:
            slots.add(d.name)
        if why := wake_blocked(d):
            blocked[d.name] = why
            blocked.update((lora, why) for lora, _ in d.adapters)
        if d.tokenizer_none:
            no_local.add(d.name)
            no_local.update(lora for lora, _ in d.adapters)
        if d.autoscaled:
            wakeable.add(d.name)
            wakeable.update(lora for lora, _ in d.adapters)
        for lora, path in d.adapters:
            statics.setdefault(lora, (d.name, path, []))
    by_name: dict[str, list[RouteRow]] = {}  # served name -> its live rank-0 shards
    for row in rows:
        name = served_name(row.profile, row.index_model)
        if not name:
            continue
        raw = row.profile.get("adapters") or []
        loras = {
            str(a["name"]): str(a.get("path", ""))
            for a in raw
            if isinstance(a, Mapping) and a.get("name")
        }
        ep = Endpoint(
            replica=row.replica,
            shard=row.shard,
            url=row.proxy_url.rstrip("/"),
            api_key=row.api_key,
            index_model=row.index_model or name,
            hash=_hash_params(row.profile),
            # A static adapter keeps its launched path where a declared one has its name (the
            # admin API refuses that; the static route wins below).
            adapters={**loaded_adapters(row, runtime), **loras},
            incarnation=row.incarnation,
            max_in_flight=row.max_in_flight or 1 << 20,
            load_metrics=row.load_metrics,
        )
        by_name.setdefault(name, []).append(row)
        of_model.setdefault(row.index_model or name, set()).add(name)
        if row.adapter_slots > 0:
            slots.add(name)
        if row.tokenizer_none:
            no_local.add(name)
            no_local.update(loras)
        served.setdefault(name, set()).update(row.apis)
        eps = models.setdefault(name, [])
        if row.ready:
            eps.append(ep)
        for lora, path in loras.items():
            _, _, lora_eps = statics.setdefault(lora, (name, path, []))
            if row.ready:
                lora_eps.append(ep)
    routes: dict[str, ModelRoute] = {}
    for name, eps in models.items():
        routes[name] = ModelRoute(
            name,
            name,
            None,
            tuple(sorted(eps, key=lambda e: e.replica)),
            name in wakeable,
            name in no_local,
            blocked.get(name, ""),
            frozenset(served.get(name) or UNKNOWN_APIS),
        )
    for lora, (base, path, eps) in statics.items():
        if lora in routes:
            log.warning("gateway_name_conflict", name=lora, kept="model", dropped="adapter")
            continue
        routes[lora] = ModelRoute(
            lora,
            base,
            (lora, path),
            tuple(sorted(eps, key=lambda e: e.replica)),
            lora in wakeable,
            # An adapter's prompts are tokenized with its base model's files.
            lora in no_local or base in no_local,
            blocked.get(lora, ""),
            # An adapter runs in its base model's processes: it serves what they serve.
            frozenset(served.get(base) or UNKNOWN_APIS),
        )
    for adapter in runtime.values():
        if (kept := routes.get(adapter.name)) is not None:
            # The admin API refuses a declared adapter named as a model or a static adapter;
            # rows that say both anyway keep what already serves.
            log.warning(
                "gateway_name_conflict", name=adapter.name,
                kept="model" if kept.lora is None else "static adapter",
                dropped="declared adapter",
            )  # fmt: skip
            continue
        route = _base_route(routes, of_model.get(adapter.model), adapter.model)
        if route is not None:
            routes[adapter.name] = _runtime_route(
                adapter, route, by_name.get(route.name, []), slots=route.name in slots
            )
    names = {n: r.base for n, r in routes.items() if r.lora is not None}
    return RouteTable(routes, read_at, names)


def _base_route(
    routes: Mapping[str, ModelRoute], names: set[str] | None, model: str
) -> ModelRoute | None:
    """The route a declared adapter of ``model`` belongs to: the one named as the model, else
    (a profile with a served_model_name) the first of its served names. None: the model is
    not routed (no deployment, no replica), so neither is the adapter (404)."""
    for name in sorted(names or (), key=lambda n: (n != model, n)):
        route = routes.get(name)
        if route is not None and route.lora is None:
            return route
    return None


def _runtime_route(
    adapter: AdapterRow, base: ModelRoute, rows: list[RouteRow], *, slots: bool
) -> ModelRoute:
    """A declared adapter's route: its base's ready replicas whose engine reports it loaded."""
    eps = tuple(ep for ep in base.endpoints if adapter.name in ep.adapters)
    return ModelRoute(
        adapter.name,
        base.name,
        (adapter.name, adapter.path),
        eps,
        # Held while it is placed and loaded: at once where its base serves, else as long as
        # its base would be held (a wake from zero, then a load).
        wakeable=bool(base.endpoints) or base.wakeable,
        tokenizer_none=base.tokenizer_none,
        # Its base's wake trouble blocks it only while no replica of the base is ready.
        wake_blocked="" if base.endpoints else base.wake_blocked,
        apis=base.apis,
        runtime=True,
        adapter_blocked=None if eps else adapter_blocked(adapter, rows, slots=slots),
    )


class RouteCache(NotifiedCache):
    """The table, re-read on NOTIFY (and every ``refresh_s``, a safety net); the last good one
    while Postgres is down."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        notify: NotifyHub | None,
        refresh_s: float,
    ) -> None:
        # Admin changes (names, adapters) and route changes (replicas' states, the adapters
        # their engines load: the shards trigger fires on observed_adapters).
        super().__init__(
            "routes",
            notify=notify,
            channels=[CHANGE_CHANNEL, ROUTES_CHANNEL],
            refresh_s=refresh_s,
        )
        self._sessions = sessions
        self.table = RouteTable({}, 0.0)
        self.changed = asyncio.Event()  # set after every successful refresh (tests wait on it)

    async def refresh(self) -> None:
        async with self._sessions() as session, session.begin():
            rows = await read_routes(session)
            declared = await read_declared(session)
            adapters = await read_adapters(session)
        self.table = build_table(
            rows, read_at=time.monotonic(), declared=declared, adapters=adapters
        )
        self.changed.set()

    def holds(self) -> int:
        return len(self.table.routes)
