"""The SQL of the gateway's route table: the three statements ``RouteCache`` reads it with,
and the rows they return.

One statement reads every live rank-0 shard with its replica's state, its launch spec's
profile (whose engine names the metrics its load is read from, ``llmgw.engines``) and its
runtime adapters (the leader's placement and what its agent reports, issue [lora]); one every
deployment's names; one every declared adapter (``kind: adapter``). ``gateway.routes.build_table``
turns the rows into the table. All take a session and write nothing.

What this module must NOT do: put an engine key (``RouteRow.api_key``) in a repr or a log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.engines import (
    ANY_ENGINE_LOAD_METRICS,
    LoadMetrics,
    Profile,
    default_max_in_flight,
    engine_load_metrics,
    reference_engine,
)
from llmgw.errors import LlmgwError

__all__ = [
    "AdapterRow",
    "DeclaredRow",
    "ObservedAdapter",
    "RouteRow",
    "read_adapters",
    "read_declared",
    "read_routes",
]

# The agents' reports are bounded by the protocol (MAX_RUNTIME_ADAPTERS per shard, reasons of
# MAX_REASON_CHARS); a row of another release is read defensively, never trusted for more.
_REASON_CHARS = 2048


@dataclass(frozen=True, slots=True)
class ObservedAdapter:
    """One runtime adapter on a shard's engine as its agent last reported it
    (``shards.observed_adapters``, ``protocol.AdapterObserved``)."""

    name: str
    # protocol.AdapterState: loading, loaded, failed, unloading. Only "loaded" routes requests;
    # a state this release does not know reads as not loaded.
    state: str
    reason: str = ""  # the engine's (or the node policy's) answer to the last failed load


@dataclass(frozen=True, slots=True)
class AdapterRow:
    """A declared adapter (``kind: adapter``, the ``adapters`` table): what clients send as
    ``model``, the base model's name (``models.name``, not a served name) and where nodes
    load it from."""

    name: str
    model: str
    path: str


@dataclass(frozen=True, slots=True)
class RouteRow:
    shard: str
    replica: str
    proxy_url: str
    api_key: str = field(repr=False)
    ready: bool
    index_model: str
    profile: Mapping[str, Any]
    incarnation: str = ""
    # The gateways' admission ceiling for the replica: the profile's live max_in_flight (an
    # edit takes effect without a roll), else the engine's default for the launched profile.
    max_in_flight: int = 0
    # The profile that launched the shard says `tokenizer: none` (its live value, else the one
    # its launch spec carries): the gateways never tokenize the model's prompts themselves.
    tokenizer_none: bool = False
    # Where the launched profile's engine reports its load on /metrics (``Engine.load_metrics``):
    # the gateways scrape it without knowing any engine's names.
    load_metrics: LoadMetrics = ANY_ENGINE_LOAD_METRICS
    # The API families the replica serves (``llmgw.engines.API_GROUPS``): the live profile it
    # was launched from lists them (an edit takes effect without a roll), else the value its
    # launch spec carries, else its engine's default for the launched process
    # (``Engine.served_apis``). Empty: nothing known (an unreadable launch spec).
    apis: frozenset[str] = frozenset()
    # Runtime adapters (issue [lora]): the names the leader placed on the shard's engine
    # (``shards.desired_adapters``), and the engine's adapters as its agent reports them.
    desired_adapters: frozenset[str] = frozenset()
    observed_adapters: tuple[ObservedAdapter, ...] = ()
    # The runtime adapters its engine may hold (the launched or the live profile's
    # adapter_slots, the larger): 0, the leader places none on it.
    adapter_slots: int = 0


@dataclass(frozen=True, slots=True)
class DeclaredRow:
    """A deployment's names, whatever its replicas do: a model scaled to zero, or between
    replicas in a rollout, is still a model (503, retry), never an unknown one (404)."""

    name: str
    adapters: tuple[tuple[str, str], ...] = ()
    # The deployment has an autoscale policy and is not suspended by an operator: a request
    # finding no ready replica is held (its demand wakes one), not refused at once.
    autoscaled: bool = False
    # The deployment's profile says `tokenizer: none`.
    tokenizer_none: bool = False
    # What the leader knows of a wake's trouble: its rollout status line (it names a replica
    # it cannot place), and the last reason an engine of its replicas crash-looped with
    # (a shard the agent reports `failed`); ``gateway.routes`` reads them into the reason a
    # held request is answered with.
    status_reason: str = ""
    crash_reason: str | None = None
    # The API families the deployment's profile serves: its own list, else its engine's default
    # for it. Empty: nothing known.
    apis: frozenset[str] = frozenset()
    # The deployment's model (``models.name``), what a declared adapter names as its base;
    # "": the served name is the model's.
    model: str = ""
    # The deployment's profile's adapter_slots: above 0, the leader may place runtime adapters
    # on its replicas (at zero replicas too: a wake, then a load).
    adapter_slots: int = 0


_READ = text(
    "SELECT s.id::text AS shard, s.replica_id::text AS replica, s.proxy_url, s.engine_api_key, "
    "(s.observed_state = 'ready' AND s.desired_state = 'running' AND r.state = 'active' "
    "AND s.proxy_url <> '') AS ready, "
    "coalesce(m.name, s.launch_spec #>> '{profile,model}', '') AS index_model, "
    "coalesce(s.launch_spec -> 'profile', '{}'::jsonb) AS profile, "
    "concat_ws(':', s.boot_id, s.pid, s.process_start_time) AS incarnation, "
    "coalesce(p.max_in_flight, 0) AS max_in_flight, "
    "coalesce(lp.tokenizer, s.launch_spec #>> '{profile,tokenizer}', '') = 'none' "
    "AS tokenizer_none, "
    # NULL where the launching profile is gone: the launch spec's value counts then.
    "lp.apis AS live_apis, "
    "s.desired_adapters, s.observed_adapters, lp.adapter_slots AS live_adapter_slots "
    "FROM shards s JOIN replicas r ON r.id = s.replica_id "
    "LEFT JOIN deployments d ON d.id = r.deployment_id "
    "LEFT JOIN models m ON m.id = d.model_id "
    "LEFT JOIN profiles p ON p.id = d.profile_id "
    # The profile the shard was launched from, by the name its spec carries: during a rollout
    # to another profile it is not the deployment's.
    "LEFT JOIN profiles lp ON lp.name = s.launch_spec #>> '{profile,name}' "
    "WHERE NOT s.released AND s.rank = 0 AND r.state <> 'stopping'"
)


_DECLARED = text(
    "SELECT coalesce(nullif(p.served_model_name, ''), m.name) AS name, m.name AS model, "
    "p.adapters, p.adapter_slots, "
    "(d.autoscale IS NOT NULL AND d.state = 'active') "
    "AS autoscaled, p.tokenizer = 'none' AS tokenizer_none, "
    "p.engine, p.args, p.apis, "
    "coalesce(ds.reason, '') AS status_reason, "
    # A crash loop the agent reported on a replica still active or being replaced (a shard
    # is released once its agent reports it gone): the newest one's reason.
    "(SELECT coalesce(nullif(s.observed_reason, ''), 'exit code ' || s.exit_code::text, "
    "'failed') FROM replicas r JOIN shards s ON s.replica_id = r.id "
    "WHERE r.deployment_id = d.id AND NOT s.released AND s.observed_state = 'failed' "
    "ORDER BY s.observed_at DESC NULLS LAST LIMIT 1) AS crash_reason "
    "FROM deployments d JOIN models m ON m.id = d.model_id "
    "JOIN profiles p ON p.id = d.profile_id "
    "LEFT JOIN deployment_status ds ON ds.deployment_id = d.id"
)

_ADAPTERS = text("SELECT name, model, path FROM adapters ORDER BY name")


async def read_declared(session: AsyncSession) -> list[DeclaredRow]:
    """Every deployment's served name and adapters, in one statement."""
    result = await session.execute(_DECLARED)
    out = []
    for r in result:
        raw = r.adapters if isinstance(r.adapters, list) else []
        loras = tuple(
            (str(a["name"]), str(a.get("path", "")))
            for a in raw
            if isinstance(a, dict) and a.get("name")
        )
        out.append(
            DeclaredRow(
                str(r.name),
                loras,
                bool(r.autoscaled),
                bool(r.tokenizer_none),
                status_reason=r.status_reason or "",
                crash_reason=r.crash_reason,
                apis=_declared_apis(r.engine, r.args, r.apis),
                model=str(r.model),
                adapter_slots=int(r.adapter_slots or 0),
            )
        )
    return out


async def read_adapters(session: AsyncSession) -> list[AdapterRow]:
    """Every declared adapter, in one statement."""
    result = await session.execute(_ADAPTERS)
    return [AdapterRow(str(r.name), str(r.model), str(r.path)) for r in result]


async def read_routes(session: AsyncSession) -> list[RouteRow]:
    """Every live rank-0 shard with what routing needs, in one statement."""
    result = await session.execute(_READ)
    out = []
    for r in result:
        launched = _launched(r.profile)
        out.append(
            RouteRow(
                shard=r.shard,
                replica=r.replica,
                proxy_url=r.proxy_url or "",
                api_key=r.engine_api_key or "",
                ready=bool(r.ready),
                index_model=r.index_model or "",
                profile=r.profile if isinstance(r.profile, dict) else {},
                incarnation=r.incarnation or "",
                max_in_flight=r.max_in_flight or _default_ceiling(launched),
                tokenizer_none=bool(r.tokenizer_none),
                load_metrics=_load_metrics(r.profile),
                apis=_launched_apis(launched, r.live_apis),
                desired_adapters=frozenset(_desired_names(r.desired_adapters)),
                observed_adapters=tuple(_observed(r.observed_adapters)),
                adapter_slots=max(
                    r.live_adapter_slots or 0, launched.adapter_slots if launched else 0
                ),
            )
        )
    return out


def _desired_names(raw: object) -> list[str]:
    """The names in ``shards.desired_adapters`` ([{"name", "path", "pinned"}])."""
    if not isinstance(raw, list):
        return []
    return [str(a["name"]) for a in raw if isinstance(a, dict) and a.get("name")]


def _observed(raw: object) -> list[ObservedAdapter]:
    """``shards.observed_adapters`` ([{"name", "state", "reason", "failures"}]) as read."""
    if not isinstance(raw, list):
        return []
    return [
        ObservedAdapter(
            str(a["name"]), str(a.get("state") or ""), str(a.get("reason") or "")[:_REASON_CHARS]
        )
        for a in raw
        if isinstance(a, dict) and a.get("name")
    ]


def _load_metrics(profile: object) -> LoadMetrics:
    """The launched profile's engine's load metrics (an unreadable profile's: any engine's)."""
    engine = profile.get("engine") if isinstance(profile, dict) else None
    return engine_load_metrics(engine) if isinstance(engine, str) else ANY_ENGINE_LOAD_METRICS


def _launched(profile: object) -> Profile | None:
    """The launch spec's profile as the engines package reads it; None where it cannot (a
    launch spec of another release)."""
    try:
        return Profile.model_validate(profile if isinstance(profile, dict) else {})
    except ValueError:  # pydantic's ValidationError is one
        return None


def _default_ceiling(launched: Profile | None) -> int:
    """The engine's default ceiling for a launched profile; a profile the engines package
    cannot read (a launch spec of an older release) gets the unknown engine's."""
    try:
        return default_max_in_flight(launched or Profile(name="unknown", engine="unknown"))
    except (ValueError, LlmgwError):
        return default_max_in_flight(Profile(name="unknown", engine="unknown"))


def _engine_apis(profile: Profile) -> frozenset[str]:
    """``profile``'s API families as its engine says (its own list, else the engine's
    default); an engine this release does not know: the list alone (empty: nothing known)."""
    try:
        return reference_engine(profile.engine).served_apis(profile)
    except LlmgwError:
        return frozenset(profile.apis)


def _launched_apis(launched: Profile | None, live: Sequence[str] | None) -> frozenset[str]:
    """A replica's API families: those of the live profile it was launched from where that
    lists any; else its engine's default for the process it runs (the launch spec's engine and
    args: an edit of them rolls the replica, so the launched ones are what serves), the
    launch spec's own list counting only where the profile is gone (``live`` None)."""
    if live:
        return frozenset(live)
    if launched is None:
        return frozenset()
    if live is not None:  # the live profile lists none: the engine's default, not the old list
        launched = launched.model_copy(update={"apis": ()})
    return _engine_apis(launched)


def _declared_apis(engine: object, args: object, apis: Sequence[str] | None) -> frozenset[str]:
    """A deployment's profile's API families: its list, else its engine's default. Only the
    engine and its args decide a default (``Engine.default_apis``), so only they are read."""
    if apis:
        return frozenset(apis)
    try:
        profile = Profile(
            name="declared",
            engine=str(engine),
            args=tuple(str(a) for a in args) if isinstance(args, list) else (),
        )
    except ValueError:
        return frozenset()
    return _engine_apis(profile)
