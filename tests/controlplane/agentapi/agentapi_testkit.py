"""A real agent API under uvicorn on a free port, and builders for the rows the reconciler writes.

``running_agent_api`` serves a FastAPI app with ``install_agent_api`` on 127.0.0.1 in the
test's own event loop: requests go over real HTTP to a real Postgres. ``place_shard`` inserts a
model, profile, deployment, replica, shard and its gpu_assignments the way the reconciler does
(one transaction, the node's desired_version bumped with it).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy import CursorResult, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.config import AgentApiSettings
from llmgw.controlplane.agentapi.endpoints import install_agent_api
from llmgw.controlplane.agentapi.service import AgentApi
from llmgw.controlplane.instances import InstanceIdentity
from llmgw.engines import Profile, ReplicaId, ShardId, ShardSpec
from llmgw.protocol.sync import (
    REGISTER_PATH,
    SYNC_PATH,
    GpuDevice,
    NodeInventory,
    RegisterRequest,
    RegisterResponse,
    ShardBinding,
    SyncRequest,
    SyncResponse,
)
from llmgw.store.bootstrap_tokens import create_bootstrap_token
from llmgw.store.database import create_engine, session_factory
from tests.support.procs import free_port

__all__ = [
    "AgentApiServer",
    "Node",
    "count",
    "fetch",
    "make_token",
    "place_shard",
    "running_agent_api",
    "sim_inventory",
]

FAST = AgentApiSettings(
    heartbeat_flush_s=0.2, instance_heartbeat_s=0.5, placed_refresh_s=0.5, node_refresh_s=0
)


@dataclass
class Node:
    id: str
    credential: str
    name: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.credential}"}


@dataclass
class AgentApiServer:
    base_url: str
    api: AgentApi
    sessions: async_sessionmaker[AsyncSession]
    client: httpx.AsyncClient
    registry: CollectorRegistry
    instance: InstanceIdentity

    async def register(
        self, token: str, name: str, *, gpus: int = 2, expect: int = 200
    ) -> RegisterResponse | httpx.Response:
        body = RegisterRequest(
            bootstrap_token=token,
            node_name=name,
            mgmt_addr="127.0.0.1",
            inventory=sim_inventory(gpus),
            agent_version="test",
        )
        r = await self.client.post(REGISTER_PATH, content=body.model_dump_json())
        assert r.status_code == expect, r.text
        if expect != 200:
            return r
        return RegisterResponse.model_validate_json(r.content)

    async def node(self, token: str, name: str, *, gpus: int = 2) -> Node:
        got = await self.register(token, name, gpus=gpus)
        assert isinstance(got, RegisterResponse)
        return Node(got.node_id, got.node_credential, name)

    async def sync_raw(
        self,
        node: Node,
        *,
        epoch: int = 1,
        seq: int,
        desired_version: str | None = None,
        bindings: Sequence[ShardBinding] = (),
        inventory: NodeInventory | None = None,
        node_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        body = SyncRequest(
            node_id=node_id or node.id,
            agent_epoch=epoch,
            seq=seq,
            desired_version=desired_version,
            bindings=tuple(bindings),
            inventory=inventory,
        )
        return await self.client.post(
            SYNC_PATH,
            content=body.model_dump_json(),
            headers=node.auth if headers is None else headers,
        )

    async def sync(self, node: Node, **kw: Any) -> SyncResponse:
        r = await self.sync_raw(node, **kw)
        assert r.status_code == 200, r.text
        return SyncResponse.model_validate_json(r.content)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


def sim_inventory(gpus: int) -> NodeInventory:
    return NodeInventory(
        gpus=tuple(
            GpuDevice(index=i, uuid=f"GPU-sim-{i}", name="sim", gpu_class="sim", simulated=True)
            for i in range(gpus)
        ),
        cpu_threads=8,
        source="sim",
    )


@asynccontextmanager
async def running_agent_api(
    db_url: str,
    *,
    settings: AgentApiSettings = FAST,
    instance_id: str = "cp-test",
) -> AsyncIterator[AgentApiServer]:
    engine = create_engine(db_url, pool_size=5)
    sessions = session_factory(engine)
    port = free_port()
    identity = InstanceIdentity(instance_id, f"http://127.0.0.1:{port}")
    registry = CollectorRegistry()
    app = FastAPI()
    api = install_agent_api(
        app, settings=settings, sessions=sessions, instance=identity, registry=registry
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on"
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(400):
            if server.started:
                break
            if task.done():
                task.result()
                raise AssertionError("uvicorn stopped before it started")
            await asyncio.sleep(0.025)
        else:
            raise AssertionError("uvicorn did not start within 10 s")
        async with httpx.AsyncClient(base_url=identity.internal_url, timeout=10.0) as client:
            yield AgentApiServer(identity.internal_url, api, sessions, client, registry, identity)
    finally:
        server.should_exit = True
        await task
        await engine.dispose()


async def make_token(
    sessions: async_sessionmaker[AsyncSession],
    *,
    pool: str = "default",
    ttl_s: float = 3600,
    uses: int | None = None,
    require_approval: bool = False,
) -> str:
    async with sessions() as session, session.begin():
        _, plaintext = await create_bootstrap_token(
            session, pool=pool, ttl_s=ttl_s, uses=uses, require_approval=require_approval
        )
    return plaintext


async def fetch(sessions: async_sessionmaker[AsyncSession], sql: str, **params: Any) -> list[Any]:
    async with sessions() as session, session.begin():
        return list((await session.execute(text(sql), params)).all())


async def count(sessions: async_sessionmaker[AsyncSession], table: str) -> int:
    rows = await fetch(sessions, f"SELECT count(*) FROM {table}")
    return int(rows[0][0])


def launch_spec(shard_id: str, replica_id: str, *, model: str, kv_events: bool) -> dict[str, Any]:
    spec = ShardSpec(
        replica_id=ReplicaId(replica_id),
        shard_id=ShardId(shard_id),
        profile=Profile(
            name=f"{model}-sim",
            engine="sim",
            gpu_class="sim",
            model_path=f"sim://{model}",
            model=model,
            kv_events=kv_events,
        ),
    )
    return spec.model_dump(mode="json", exclude={"api_key", "secret_env"})


async def place_shard(
    sessions: async_sessionmaker[AsyncSession],
    node_id: str,
    *,
    gpus: Sequence[int | tuple[int, str]] = (0,),
    model: str | None = None,
    desired_state: str = "running",
    kv_events: bool = False,
    api_key: str = "engine-key",
    spec: dict[str, Any] | None = None,
) -> str:
    """Insert what the reconciler's CreateReplica writes; returns the shard id.

    ``gpus``: whole GPUs by index, or (parent index, "MIG-<uuid>") for a MIG slice, in the
    engine's device order.
    """
    model = model or f"m-{uuid.uuid4().hex[:8]}"
    shard_id, replica_id = str(uuid.uuid4()), str(uuid.uuid4())
    async with sessions() as session, session.begin():

        async def one(sql: str, **params: Any) -> Any:
            result = cast(CursorResult[Any], await session.execute(text(sql), params))
            return result.scalar() if result.returns_rows else None

        model_id = await one("INSERT INTO models (name) VALUES (:n) RETURNING id", n=model)
        profile_id = await one(
            "INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, kv_hash_seed, "
            "fingerprint) VALUES (:n, :m, 'sim', 'sim', :p, '42', 'fp-1') RETURNING id",
            n=f"{model}-sim",
            m=model_id,
            p=f"sim://{model}",
        )
        deployment_id = await one(
            "INSERT INTO deployments (name, model_id, profile_id) VALUES (:n, :m, :p) RETURNING id",
            n=model,
            m=model_id,
            p=profile_id,
        )
        await one(
            "INSERT INTO replicas (id, deployment_id, profile_fingerprint) "
            "VALUES (:id, :d, 'fp-1')",
            id=replica_id,
            d=deployment_id,
        )
        body = (
            spec
            if spec is not None
            else launch_spec(shard_id, replica_id, model=model, kv_events=kv_events)
        )
        await one(
            "INSERT INTO shards (id, replica_id, node_id, rank, launch_spec, "
            "profile_fingerprint, desired_state, engine_api_key) "
            "VALUES (:id, :r, :n, 0, CAST(:spec AS jsonb), 'fp-1', :ds, :key)",
            id=shard_id,
            r=replica_id,
            n=node_id,
            spec=json.dumps(body),
            ds=desired_state,
            key=api_key,
        )
        for position, gpu in enumerate(gpus):
            index, mig = (gpu, None) if isinstance(gpu, int) else gpu
            await one(
                "INSERT INTO gpu_assignments (shard_id, position, node_id, gpu_index, mig_uuid) "
                "VALUES (:s, :p, :n, :i, :m)",
                s=shard_id,
                p=position,
                n=node_id,
                i=index,
                m=mig,
            )
        await one("UPDATE nodes SET desired_version = desired_version + 1 WHERE id = :n", n=node_id)
    return shard_id


async def set_desired_state(
    sessions: async_sessionmaker[AsyncSession], shard_id: str, state: str
) -> None:
    """What the reconciler's StopReplica does to one shard: state and the node's ETag, together."""
    async with sessions() as session, session.begin():
        await session.execute(
            text("UPDATE shards SET desired_state = :s WHERE id = :id"),
            {"s": state, "id": shard_id},
        )
        await session.execute(
            text(
                "UPDATE nodes SET desired_version = desired_version + 1 "
                "WHERE id = (SELECT node_id FROM shards WHERE id = :id)"
            ),
            {"id": shard_id},
        )
