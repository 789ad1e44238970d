"""The SQL of the gateway's route table: the two statements ``RouteCache`` reads it with,
and the rows they return.

One statement reads every live rank-0 shard with its replica's state and its launch spec's
profile (whose engine names the metrics its load is read from, ``llmgw.engines``), the other
every deployment's names; ``gateway.routes.build_table`` turns the rows
into the table. Both take a session and write nothing.

What this module must NOT do: put an engine key (``RouteRow.api_key``) in a repr or a log.
"""

from __future__ import annotations

from collections.abc import Mapping
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
)
from llmgw.errors import LlmgwError

__all__ = ["DeclaredRow", "RouteRow", "read_declared", "read_routes"]


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


_READ = text(
    "SELECT s.id::text AS shard, s.replica_id::text AS replica, s.proxy_url, s.engine_api_key, "
    "(s.observed_state = 'ready' AND s.desired_state = 'running' AND r.state = 'active' "
    "AND s.proxy_url <> '') AS ready, "
    "coalesce(m.name, s.launch_spec #>> '{profile,model}', '') AS index_model, "
    "coalesce(s.launch_spec -> 'profile', '{}'::jsonb) AS profile, "
    "concat_ws(':', s.boot_id, s.pid, s.process_start_time) AS incarnation, "
    "coalesce(p.max_in_flight, 0) AS max_in_flight, "
    "coalesce(lp.tokenizer, s.launch_spec #>> '{profile,tokenizer}', '') = 'none' "
    "AS tokenizer_none "
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
    "SELECT coalesce(nullif(p.served_model_name, ''), m.name) AS name, p.adapters, "
    "(d.autoscale IS NOT NULL AND d.state = 'active') "
    "AS autoscaled, p.tokenizer = 'none' AS tokenizer_none, "
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
            )
        )
    return out


async def read_routes(session: AsyncSession) -> list[RouteRow]:
    """Every live rank-0 shard with what routing needs, in one statement."""
    result = await session.execute(_READ)
    return [
        RouteRow(
            shard=r.shard,
            replica=r.replica,
            proxy_url=r.proxy_url or "",
            api_key=r.engine_api_key or "",
            ready=bool(r.ready),
            index_model=r.index_model or "",
            profile=r.profile if isinstance(r.profile, dict) else {},
            incarnation=r.incarnation or "",
            max_in_flight=r.max_in_flight or _default_ceiling(r.profile),
            tokenizer_none=bool(r.tokenizer_none),
            load_metrics=_load_metrics(r.profile),
        )
        for r in result
    ]


def _load_metrics(profile: object) -> LoadMetrics:
    """The launched profile's engine's load metrics (an unreadable profile's: any engine's)."""
    engine = profile.get("engine") if isinstance(profile, dict) else None
    return engine_load_metrics(engine) if isinstance(engine, str) else ANY_ENGINE_LOAD_METRICS


def _default_ceiling(profile: object) -> int:
    """The engine's default ceiling for a launched profile; a profile the engines package
    cannot read (a launch spec of an older release) gets the unknown engine's."""
    doc = profile if isinstance(profile, dict) else {}
    try:
        return default_max_in_flight(Profile.model_validate(doc))
    except (ValueError, LlmgwError):
        return default_max_in_flight(Profile(name="unknown", engine="unknown"))
