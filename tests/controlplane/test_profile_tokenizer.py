"""A profile's ``tokenizer`` (empty, ``none`` or a directory on the nodes), end to end against a
real control plane and Postgres: refused with a 422 naming the field and the fix, stored and
returned by the admin API, ``POST /apply`` and ``llmgw apply``, never in the fingerprint; carried
by the launch specs of shards placed after an edit (what the agents read); read live by the
route table, so a gateway that loaded a model's files stops tokenizing its prompts within
seconds of an edit to ``none`` (``llmgw status``: ``remote (profile)``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import CursorResult, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from llmgw.commands.status import tokenizer_modes
from llmgw.controlplane.agentapi.sync import desired_shard
from llmgw.controlplane.profile_checks import check_profile
from llmgw.controlplane.reconcile.leader import LeaderLock
from llmgw.controlplane.reconcile.loop import Reconciler
from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.routes import build_table
from llmgw.planner.snapshot import PlanSettings
from llmgw.simengine.hf_tokens import read_tokenizer_dir, tiny_model_dir
from llmgw.store.agent_shards import read_desired_shards
from llmgw.store.database import create_engine, session_factory
from llmgw.store.routes import read_declared, read_routes
from llmgw.store.tokenizers import store_model_tokenizer
from tests.controlplane.admin.admin_testkit import ControlPlane, name, run_cli, sql
from tests.controlplane.agentapi.agentapi_testkit import launch_spec, place_shard
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


def _profile_body(model: str, profile: str, **extra: Any) -> dict[str, Any]:
    return {"name": profile, "model": model, "engine": "sim", "model_path": "/models/demo",
            "kv_events": True, **extra}  # fmt: skip


def _create(
    client: httpx.Client, *, profile_extra: dict[str, Any] | None = None
) -> tuple[str, str, str]:
    model, profile, dep = name("tk"), name("tk-p"), name("tk-d")
    assert client.post("/models", json={"name": model}).status_code == 201
    r = client.post("/profiles", json=_profile_body(model, profile, **(profile_extra or {})))
    assert r.status_code == 201, r.text
    r = client.post(
        "/deployments", json={"name": dep, "model": model, "profile": profile, "replicas": 1}
    )
    assert r.status_code == 201, r.text
    return model, profile, dep


# --- the admin API --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("None", "tokenizer: Value error, the keyword is 'none', in lower case"),
        ("tokenizer-dir", "tokenizer: Value error, must be the absolute path of a directory"),
        ("auto", "'none' (the model has no local tokenizer"),
        ("/models/tok\n/other", "tokenizer: Value error, must not hold a NUL character or a line"),
        ("/models/\x00tok", "must not hold a NUL character or a line break"),
        ("/" + "t" * 4096, "tokenizer: String should have at most 4096 characters"),
    ],
)
@pytest.mark.e2e
def test_a_bad_tokenizer_is_a_422_naming_the_field_and_the_fix(
    client: httpx.Client, value: str, message: str
) -> None:
    model = name("tk")
    assert client.post("/models", json={"name": model}).status_code == 201
    r = client.post("/profiles", json=_profile_body(model, name("tk-p"), tokenizer=value))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["field"]) == ("spec-invalid", "tokenizer")
    assert message in error["message"], error["message"]
    # The same rule on an update, which leaves the stored profile as it was.
    good = client.post("/profiles", json=_profile_body(model, name("tk-p"))).json()
    r = client.patch(
        f"/profiles/{good['name']}", json={"version": good["version"], "tokenizer": value}
    )
    assert r.status_code == 422 and message in r.json()["error"]["message"], r.text
    assert client.get(f"/profiles/{good['name']}").json()["tokenizer"] == ""


@pytest.mark.e2e
def test_edits_round_trip_and_roll_nothing(client: httpx.Client, cp: ControlPlane) -> None:
    _, profile, dep = _create(client)
    stored = client.get(f"/profiles/{profile}").json()
    assert stored["tokenizer"] == ""  # the engine's own
    version = stored["version"]
    for value in ("none", "/models/demo-tokenizer", ""):
        r = client.patch(f"/profiles/{profile}", json={"version": version, "tokenizer": value})
        assert r.status_code == 200, r.text
        got = client.get(f"/profiles/{profile}").json()
        assert got["tokenizer"] == value
        assert (got["fingerprint"], got["version"]) == (stored["fingerprint"], version + 1)
        version = got["version"]
    # No new spec for the deployment: its generation never moved.
    assert client.get(f"/deployments/{dep}").json()["generation"] == 1
    assert sql(cp.db_url, "SELECT tokenizer FROM profiles WHERE name = %s", (profile,)) == [("",)]


@pytest.mark.e2e
def test_apply_and_the_cli_take_the_field(
    client: httpx.Client, cp: ControlPlane, tmp_path: Path
) -> None:
    model, profile = name("tk"), name("tk-p")
    docs = [{"kind": "model", "name": model},
            {"kind": "profile", **_profile_body(model, profile, tokenizer="none")}]  # fmt: skip
    r = client.post("/apply", json={"documents": docs})
    assert r.status_code == 200, r.text
    assert client.get(f"/profiles/{profile}").json()["tokenizer"] == "none"
    bad = [{"kind": "profile", **_profile_body(model, profile, tokenizer="relative/dir")}]
    r = client.post("/apply", json={"documents": bad})
    assert r.status_code == 422, r.text
    [problem] = r.json()["error"]["problems"]
    assert "tokenizer" in problem["message"] and "absolute path" in problem["message"]

    fingerprint = client.get(f"/profiles/{profile}").json()["fingerprint"]
    f = tmp_path / "fleet.yaml"
    f.write_text(
        f"kind: profile\nname: {profile}\nmodel: {model}\nengine: sim\n"
        "model_path: /models/demo\nkv_events: true\ntokenizer: /models/demo-tokenizer\n"
    )
    dry = run_cli(cp, "apply", "-f", str(f), "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        f"profile/{profile} configured (dry run)",
        "    tokenizer: none → /models/demo-tokenizer",
        "    no roll",
    ], dry.stdout
    applied = run_cli(cp, "apply", "-f", str(f))
    assert applied.stdout.splitlines() == [f"profile/{profile} configured"], applied.stdout
    got = client.get(f"/profiles/{profile}").json()
    assert (got["tokenizer"], got["fingerprint"]) == ("/models/demo-tokenizer", fingerprint)
    assert run_cli(cp, "apply", "-f", str(f)).stdout.splitlines() == [
        f"profile/{profile} unchanged"
    ]


# --- the gateway ----------------------------------------------------------------------------


def _store_tiny_files(db_url: str, model: str) -> None:
    """What the agent API stores when an agent ships the tiny model's files for ``model``."""
    files = read_tokenizer_dir(tiny_model_dir())

    async def store() -> None:
        engine = create_engine(db_url, pool_size=1)
        try:
            async with session_factory(engine)() as session, session.begin():
                await store_model_tokenizer(
                    session, model=model, digest=files.digest, files=files.files, source="test"
                )
        finally:
            await engine.dispose()

    asyncio.run(store())


def _gateway_view(cp: ControlPlane, model: str) -> tuple[dict[str, str], float]:
    """(``llmgw status``'s TOKENIZING per model, llmgw_prefix_tokenizer_profile_none of
    ``model``) as the control plane's /metrics says now."""
    r = httpx.get(f"{cp.url}/metrics", headers=cp.headers, timeout=10)
    assert r.status_code == 200
    none = -1.0
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "llmgw_prefix_tokenizer_profile_none" and s.labels["model"] == model:
                none = s.value
    return tokenizer_modes(r.text), none


def _until(cp: ControlPlane, model: str, mode: str, none: float, deadline_s: float = 15) -> float:
    t0 = time.monotonic()

    def settled() -> bool:
        modes, got_none = _gateway_view(cp, model)
        return modes.get(model) == mode and got_none == none

    wait_for(settled, timeout_s=deadline_s, what=f"{model}: {mode}, none {none}", interval_s=0.1)
    return time.monotonic() - t0


@pytest.mark.e2e
def test_an_edit_to_none_stops_local_tokenizing_within_seconds(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model, profile, _ = _create(client)
    _store_tiny_files(cp.db_url, model)
    # The files loaded: the gateway tokenizes the model's prompts itself.
    _until(cp, model, "local", 0.0)
    version = client.get(f"/profiles/{profile}").json()["version"]
    r = client.patch(f"/profiles/{profile}", json={"version": version, "tokenizer": "none"})
    assert r.status_code == 200, r.text
    took = _until(cp, model, "remote (profile)", 1.0)
    print(f"the gateway stopped tokenizing {model} locally {took:.2f} s after the edit")
    # And back: the files stored before are used again, with no agent shipping anything.
    r = client.patch(f"/profiles/{profile}", json={"version": version + 1, "tokenizer": ""})
    assert r.status_code == 200, r.text
    _until(cp, model, "local", 0.0)


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


async def _table(sessions: async_sessionmaker[AsyncSession]) -> Callable[[str], bool]:
    async with sessions() as session, session.begin():
        rows, declared = await read_routes(session), await read_declared(session)
    routes = build_table(rows, read_at=1.0, declared=declared).routes
    return lambda n: routes[n].tokenizer_none


async def test_the_route_says_none_when_any_profile_serving_it_does(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    node = await _sql(sessions, "INSERT INTO nodes (name) VALUES ('n1') RETURNING id::text")
    shard = await place_shard(sessions, node, model="rt", kv_events=True)
    await _sql(
        sessions,
        "UPDATE shards SET observed_state = 'ready', proxy_url = 'http://agent:9/s' WHERE id = :id",
        id=shard,
    )
    none = await _table(sessions)
    assert not none("rt")
    # The profile's live value: no roll, no new launch spec.
    await _sql(sessions, "UPDATE profiles SET tokenizer = 'none' WHERE name = 'rt-sim'")
    assert (await _table(sessions))("rt")
    # A rollout to another profile: the deployment's says nothing, but the replica still
    # serving was launched from a profile that says none (by the name its spec carries).
    await _sql(
        sessions,
        "INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, kv_hash_seed, "
        "fingerprint) SELECT 'rt-next', model_id, 'sim', 'sim', 'sim://rt', '42', 'fp-2' "
        "FROM profiles WHERE name = 'rt-sim'",
    )
    await _sql(
        sessions,
        "UPDATE deployments SET profile_id = (SELECT id FROM profiles WHERE name = 'rt-next') "
        "WHERE name = 'rt'",
    )
    assert (await _table(sessions))("rt")
    await _sql(sessions, "UPDATE profiles SET tokenizer = '' WHERE name = 'rt-sim'")
    assert not (await _table(sessions))("rt")
    # The deployment's profile saying none is enough, whatever its replicas were launched
    # from; for its adapters' names too.
    await _sql(
        sessions,
        "UPDATE profiles SET tokenizer = 'none', adapters = CAST(:a AS jsonb) "
        "WHERE name = 'rt-next'",
        a=json.dumps([{"name": "rt-lora", "path": "/a"}]),
    )
    none = await _table(sessions)
    assert none("rt") and none("rt-lora")
    # A shard whose profile is gone: the value its launch spec carries.
    spec = launch_spec(str(uuid.uuid4()), str(uuid.uuid4()), model="gone", kv_events=True)
    spec["profile"]["name"], spec["profile"]["tokenizer"] = "deleted-profile", "none"
    await place_shard(sessions, node, gpus=(1,), model="gone", spec=spec)
    assert (await _table(sessions))("gone")


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
    assert check_profile("tp", {**fields, "tokenizer": "/models/tok"}) == fingerprint
    inventory = json.dumps(
        {"gpus": [{"index": i, "uuid": f"SIM-{i}", "name": "sim", "gpu_class": "sim",
                   "simulated": True} for i in range(2)], "cpu_threads": 8, "source": "sim"}
    )  # fmt: skip
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(
            "WITH m AS (INSERT INTO models (name) VALUES ('tm') RETURNING id), "
            "p AS (INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, "
            "kv_events, kv_hash_seed, tokenizer, fingerprint) SELECT 'tp', id, 'sim', 'sim', "
            "'sim-model', true, '4242', '/models/tok', %s FROM m RETURNING id, model_id) "
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

    async def tokenizers() -> list[str]:
        """Each live shard's tokenizer as its agent receives it (the sync's desired set)."""
        node = uuid.UUID(await _sql(sessions, "SELECT id::text FROM nodes"))
        async with sessions() as session, session.begin():
            rows = await read_desired_shards(session, node)
        return sorted(desired_shard(r).spec["profile"]["tokenizer"] for r in rows)

    try:
        assert (await reconciler.pass_once(epoch)).get("CreateReplica") == 1
        assert await tokenizers() == ["/models/tok"]
        # An edit rolls nothing: the placed shard keeps its spec.
        await _sql(sessions, "UPDATE profiles SET tokenizer = 'none' WHERE name = 'tp'")
        assert await reconciler.pass_once(epoch) == {}
        assert await tokenizers() == ["/models/tok"]
        # A shard placed after it carries the new value.
        await _sql(sessions, "UPDATE deployments SET replicas = 2 WHERE name = 'td'")
        assert (await reconciler.pass_once(epoch)).get("CreateReplica") == 1
        assert await tokenizers() == ["/models/tok", "none"]
    finally:
        await lock.release()
