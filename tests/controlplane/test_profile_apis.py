"""A profile's ``apis`` (the API families its model serves: generate, pooling, or the engine's
default when empty), end to end against a real control plane and Postgres: refused with a 422
naming the field and the values it takes, stored and returned by the admin API, ``POST /apply``
and ``llmgw apply``, never in the fingerprint; carried by the launch specs of shards placed
after an edit; read live by the route table (each name's union over the profiles serving it,
an adapter its base model's), so an edit reaches the gateways within seconds without a roll."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import httpx
import psycopg
import pytest
from sqlalchemy import CursorResult, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from llmgw.controlplane.agentapi.sync import desired_shard
from llmgw.controlplane.profile_checks import check_profile
from llmgw.controlplane.reconcile.leader import LeaderLock
from llmgw.controlplane.reconcile.loop import Reconciler
from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.routes import UNKNOWN_APIS, RouteCache, build_table
from llmgw.planner.snapshot import PlanSettings
from llmgw.store.agent_shards import read_desired_shards
from llmgw.store.database import create_engine, session_factory
from llmgw.store.notify import NotifyHub
from llmgw.store.routes import DeclaredRow, RouteRow, read_declared, read_routes
from tests.controlplane.admin.admin_testkit import ControlPlane, name, run_cli, sql
from tests.controlplane.agentapi.agentapi_testkit import launch_spec, place_shard

pytestmark = pytest.mark.timeout(60)

GEN = frozenset({"generate"})
POOL = frozenset({"pooling"})
BOTH = frozenset({"generate", "pooling"})


def _profile_body(model: str, profile: str, **extra: Any) -> dict[str, Any]:
    return {"name": profile, "model": model, "engine": "vllm", "model_path": "/models/demo",
            **extra}  # fmt: skip


def _create(client: httpx.Client, **profile_extra: Any) -> tuple[str, str, str]:
    model, profile, dep = name("ap"), name("ap-p"), name("ap-d")
    assert client.post("/models", json={"name": model}).status_code == 201
    r = client.post("/profiles", json=_profile_body(model, profile, **profile_extra))
    assert r.status_code == 201, r.text
    r = client.post(
        "/deployments", json={"name": dep, "model": model, "profile": profile, "replicas": 1}
    )
    assert r.status_code == 201, r.text
    return model, profile, dep


# --- the admin API --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        (["embeddings"], "apis.0", "apis.0: Input should be 'generate' or 'pooling'"),
        (["generate", "Pooling"], "apis.1", "Input should be 'generate' or 'pooling'"),
        (["generate", "generate"], "apis", "lists 'generate' twice: give each API family once"),
        ("pooling", "apis", "apis: Input should be a valid list"),
        (None, "apis", "apis: Input should be a valid list"),
    ],
)
@pytest.mark.e2e
def test_a_bad_list_is_a_422_naming_the_field_and_the_values(
    client: httpx.Client, value: Any, field: str, message: str
) -> None:
    model = name("ap")
    assert client.post("/models", json={"name": model}).status_code == 201
    r = client.post("/profiles", json=_profile_body(model, name("ap-p"), apis=value))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["field"]) == ("spec-invalid", field)
    assert message in error["message"], error["message"]
    # The same rule on an update, which leaves the stored profile as it was (null there is
    # "unchanged", as for every field of an update).
    good = client.post("/profiles", json=_profile_body(model, name("ap-p"))).json()
    r = client.patch(f"/profiles/{good['name']}", json={"version": good["version"], "apis": value})
    if value is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 422 and message in r.json()["error"]["message"], r.text
    assert client.get(f"/profiles/{good['name']}").json()["apis"] == []


@pytest.mark.e2e
def test_edits_round_trip_and_roll_nothing(client: httpx.Client, cp: ControlPlane) -> None:
    _, profile, dep = _create(client, args=["--runner", "pooling"])
    stored = client.get(f"/profiles/{profile}").json()
    assert stored["apis"] == []  # the engine's default
    version = stored["version"]
    for value in (["pooling"], ["pooling", "generate"], ["generate"], []):
        r = client.patch(f"/profiles/{profile}", json={"version": version, "apis": value})
        assert r.status_code == 200, r.text
        got = client.get(f"/profiles/{profile}").json()
        assert got["apis"] == value
        assert (got["fingerprint"], got["version"]) == (stored["fingerprint"], version + 1)
        version = got["version"]
    # No new spec for the deployment: its generation never moved.
    assert client.get(f"/deployments/{dep}").json()["generation"] == 1
    assert sql(cp.db_url, "SELECT apis FROM profiles WHERE name = %s", (profile,)) == [([],)]
    # Created with a list: returned as given.
    _, other, _ = _create(client, apis=["pooling", "generate"])
    assert client.get(f"/profiles/{other}").json()["apis"] == ["pooling", "generate"]


@pytest.mark.e2e
def test_apply_and_the_cli_take_the_field(
    client: httpx.Client, cp: ControlPlane, tmp_path: Path
) -> None:
    model, profile = name("ap"), name("ap-p")
    docs = [{"kind": "model", "name": model},
            {"kind": "profile", **_profile_body(model, profile, apis=["pooling"])}]  # fmt: skip
    r = client.post("/apply", json={"documents": docs})
    assert r.status_code == 200, r.text
    assert client.get(f"/profiles/{profile}").json()["apis"] == ["pooling"]
    bad = [{"kind": "profile", **_profile_body(model, profile, apis=["rerank"])}]
    r = client.post("/apply", json={"documents": bad})
    assert r.status_code == 422, r.text
    [problem] = r.json()["error"]["problems"]
    assert "apis" in str(problem) and "'generate' or 'pooling'" in problem["message"], problem

    fingerprint = client.get(f"/profiles/{profile}").json()["fingerprint"]
    f = tmp_path / "fleet.yaml"
    f.write_text(
        f"kind: profile\nname: {profile}\nmodel: {model}\nengine: vllm\n"
        "model_path: /models/demo\napis: [generate, pooling]\n"
    )
    dry = run_cli(cp, "apply", "-f", str(f), "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        f"profile/{profile} configured (dry run)",
        '    apis: ["pooling"] → ["generate", "pooling"]',
        "    no roll",
    ], dry.stdout
    applied = run_cli(cp, "apply", "-f", str(f))
    assert applied.stdout.splitlines() == [f"profile/{profile} configured"], applied.stdout
    got = client.get(f"/profiles/{profile}").json()
    assert (got["apis"], got["fingerprint"]) == (["generate", "pooling"], fingerprint)
    assert run_cli(cp, "apply", "-f", str(f)).stdout.splitlines() == [
        f"profile/{profile} unchanged"
    ]


@pytest.mark.e2e
async def test_an_edit_reaches_the_route_table_within_seconds(
    client: httpx.Client, cp: ControlPlane
) -> None:
    """Through the admin API and the database's NOTIFY alone: the cache's period is a minute,
    and nothing rolls."""
    model, profile, dep = _create(client, args=["--runner", "pooling"])
    engine = create_engine(cp.db_url, pool_size=2)
    hub = NotifyHub(libpq_url(cp.db_url), application_name="llmgw-test-apis")
    cache = RouteCache(session_factory(engine), notify=hub, refresh_s=60.0)
    await hub.start()
    await cache.start()
    try:
        await asyncio.wait_for(cache.listening.wait(), timeout=5)
        assert cache.table.routes[model].apis == POOL  # vLLM's default from --runner pooling

        async def after_edit(value: list[str]) -> float:
            """Seconds from the edit's answer to the table holding it (5 s at most)."""
            version = (await asyncio.to_thread(client.get, f"/profiles/{profile}")).json()
            body = {"version": version["version"], "apis": value}
            r = await asyncio.to_thread(client.patch, f"/profiles/{profile}", json=body)
            assert r.status_code == 200, r.text
            t0, want = time.monotonic(), frozenset(value) or POOL
            while time.monotonic() - t0 < 5:
                if cache.table.routes[model].apis == want:
                    return time.monotonic() - t0
                cache.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cache.changed.wait(), timeout=0.5)
            raise AssertionError(f"{model}: apis {value} not in the table within 5 s")

        took = await after_edit(["generate", "pooling"])
        print(f"the route table had the new apis {took:.2f} s after the edit")
        await after_edit(["generate"])
        await after_edit([])  # back to the engine's default
        assert (await asyncio.to_thread(client.get, f"/deployments/{dep}")).json()[
            "generation"
        ] == 1
    finally:
        await cache.stop()
        await hub.stop()
        await engine.dispose()


# --- the route table and the launch specs, over SQL -------------------------------------------


@pytest.fixture
async def sessions(db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine: AsyncEngine = create_engine(db_url, pool_size=2)
    try:
        yield session_factory(engine)
    finally:
        await engine.dispose()


async def _sql(sessions: async_sessionmaker[AsyncSession], query: str, **params: Any) -> Any:
    async with sessions() as session, session.begin():
        result = cast(CursorResult[Any], await session.execute(text(query), params))
        return result.scalar() if result.returns_rows else None


async def _apis(sessions: async_sessionmaker[AsyncSession], name: str) -> frozenset[str]:
    async with sessions() as session, session.begin():
        rows, declared = await read_routes(session), await read_declared(session)
    return build_table(rows, read_at=1.0, declared=declared).routes[name].apis


def _vllm_spec(model: str, profile: str, args: list[str], **extra: Any) -> dict[str, Any]:
    """A launch spec of a vLLM shard of ``profile`` (what the reconciler writes)."""
    spec = launch_spec(str(uuid.uuid4()), str(uuid.uuid4()), model=model, kv_events=False)
    spec["profile"].update(
        name=profile, engine="vllm", gpu_class="h100", model_path="/models/m", args=args, **extra
    )
    return spec


async def _to_vllm(
    sessions: async_sessionmaker[AsyncSession], profile: str, args: list[str]
) -> None:
    await _sql(
        sessions,
        "UPDATE profiles SET engine = 'vllm', args = CAST(:a AS jsonb) WHERE name = :n",
        a=json.dumps(args),
        n=profile,
    )


async def test_a_routes_apis_are_its_profiles_live_values(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    node = await _sql(sessions, "INSERT INTO nodes (name) VALUES ('n1') RETURNING id::text")
    # A vLLM replica launched with --runner pooling from a vLLM profile saying so.
    pooling = ["--runner", "pooling"]
    await place_shard(sessions, node, model="emb", spec=_vllm_spec("emb", "emb-sim", pooling))
    await _to_vllm(sessions, "emb-sim", pooling)
    assert await _apis(sessions, "emb") == POOL
    # The simulator: both, by default.
    await place_shard(sessions, node, gpus=(1,), model="sim")
    assert await _apis(sessions, "sim") == BOTH
    # An explicit list wins, and an edit is read at once: no roll, no new launch spec.
    await _sql(sessions, "UPDATE profiles SET apis = '{generate}' WHERE name = 'emb-sim'")
    assert await _apis(sessions, "emb") == GEN
    await _sql(sessions, "UPDATE profiles SET apis = '{}' WHERE name = 'emb-sim'")
    assert await _apis(sessions, "emb") == POOL
    # A rollout to a profile serving generation: the replica still serving was launched from
    # the pooling one (by the name its spec carries), so the name serves both until it goes.
    await _sql(
        sessions,
        "INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, kv_hash_seed, "
        "fingerprint) SELECT 'emb-next', model_id, 'vllm', 'h100', '/models/m', '42', 'fp-2' "
        "FROM profiles WHERE name = 'emb-sim'",
    )
    await _sql(
        sessions,
        "UPDATE deployments SET profile_id = (SELECT id FROM profiles WHERE name = 'emb-next') "
        "WHERE name = 'emb'",
    )
    assert await _apis(sessions, "emb") == BOTH
    # The deployment's profile's list counts for its adapters' names too: an adapter serves
    # what its base model's processes serve.
    await _sql(
        sessions,
        "UPDATE profiles SET apis = '{pooling}', adapters = CAST(:a AS jsonb) "
        "WHERE name = 'emb-next'",
        a=json.dumps([{"name": "emb-lora", "path": "/a"}]),
    )
    assert await _apis(sessions, "emb") == POOL
    assert await _apis(sessions, "emb-lora") == POOL
    # A shard whose profile is gone: the list its launch spec carries, else its engine's
    # default for the args it was launched with.
    # (Its deployment deleted too, so only the replica says anything of the name.)
    listed = _vllm_spec("gone", "deleted-profile", [], apis=["generate"])
    await place_shard(sessions, node, gpus=(2,), model="gone", spec=listed)
    defaulted = _vllm_spec("gone2", "deleted-profile-2", ["--convert", "embed"])
    await place_shard(sessions, node, gpus=(3,), model="gone2", spec=defaulted)
    await _sql(sessions, "DELETE FROM deployments WHERE name IN ('gone', 'gone2')")
    assert await _apis(sessions, "gone") == GEN
    assert await _apis(sessions, "gone2") == POOL


def test_a_name_nothing_is_known_of_serves_generation() -> None:
    """An unreadable launch spec and no deployment: what the gateway served before families."""
    row = RouteRow(
        shard="s", replica="r", proxy_url="http://a:1/s", api_key="k", ready=True,
        index_model="x", profile={"served_model_name": "x", "engine": "from-another-release"},
    )  # fmt: skip
    table = build_table([row], read_at=1.0)
    assert table.routes["x"].apis == UNKNOWN_APIS == GEN
    declared = [DeclaredRow("y", (("y-lora", "/l"),), apis=POOL)]
    routes = build_table([row], read_at=1.0, declared=declared).routes
    assert (routes["y"].apis, routes["y-lora"].apis, routes["x"].apis) == (POOL, POOL, GEN)


async def test_shards_placed_after_an_edit_carry_it_to_their_agents(
    db_url: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    fields = {
        "engine": "sim", "gpu_class": "sim", "tp": 1, "pp": 1, "gpus_per_node": 0, "nodes": 1,
        "model_path": "sim-model", "served_model_name": "", "args": [], "env": {},
        "secret_env": {}, "adapters": [], "kv_events": True, "threads": 0, "kv_hash_seed": "4242",
        "kv_block_size": 16, "kv_hash_algo": "sha256_cbor", "kv_extra_key_format": "tagged",
    }  # fmt: skip
    fingerprint = check_profile("tp", fields)
    assert check_profile("tp", {**fields, "apis": ["pooling"]}) == fingerprint
    inventory = json.dumps(
        {"gpus": [{"index": i, "uuid": f"SIM-{i}", "name": "sim", "gpu_class": "sim",
                   "simulated": True} for i in range(2)], "cpu_threads": 8, "source": "sim"}
    )  # fmt: skip
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(
            "WITH m AS (INSERT INTO models (name) VALUES ('tm') RETURNING id), "
            "p AS (INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, "
            "kv_events, kv_hash_seed, apis, fingerprint) SELECT 'tp', id, 'sim', 'sim', "
            "'sim-model', true, '4242', '{pooling}', %s FROM m RETURNING id, model_id) "
            "INSERT INTO deployments (name, model_id, profile_id, replicas) "
            "SELECT 'td', model_id, id, 1 FROM p",
            (fingerprint,),
        )
        conn.execute(
            "WITH n AS (INSERT INTO nodes (name, approval_state) VALUES ('n1', 'approved') "
            "RETURNING id) INSERT INTO node_status (node_id, mgmt_addr, inventory, last_sync_at) "
            "SELECT id, '127.0.0.1', %s, now() FROM n",
            (inventory,),
        )
    reconciler = Reconciler(
        sessions=sessions,
        libpq_url=libpq_url(db_url),
        instance_id="cp-a",
        plan_settings=PlanSettings(sync_period_s=1.0, sync_grace_s=30.0, drain_timeout_s=60.0),
    )
    lock = LeaderLock(libpq_url(db_url), instance_id="cp-a")
    epoch = await lock.try_acquire()
    assert epoch is not None

    async def carried() -> list[list[str]]:
        """Each live shard's apis as its agent receives them (the sync's desired set)."""
        node = uuid.UUID(await _sql(sessions, "SELECT id::text FROM nodes"))
        async with sessions() as session, session.begin():
            rows = await read_desired_shards(session, node)
        return sorted(desired_shard(r).spec["profile"]["apis"] for r in rows)

    try:
        assert (await reconciler.pass_once(epoch)).get("CreateReplica") == 1
        assert await carried() == [["pooling"]]
        # An edit rolls nothing: the placed shard keeps its spec.
        await _sql(sessions, "UPDATE profiles SET apis = '{generate}' WHERE name = 'tp'")
        assert await reconciler.pass_once(epoch) == {}
        assert await carried() == [["pooling"]]
        # A shard placed after it carries the new value.
        await _sql(sessions, "UPDATE deployments SET replicas = 2 WHERE name = 'td'")
        assert (await reconciler.pass_once(epoch)).get("CreateReplica") == 1
        assert await carried() == [["generate"], ["pooling"]]
    finally:
        await lock.release()
