"""The gateway process's parts (llmgw/serve/gateway_process.py): its private listener takes
agents' KV deltas exactly as a control plane's agent API does, registers itself where the
control plane's sync answers list it, and serves nothing else; workers share the public port
through SO_REUSEPORT."""

from __future__ import annotations

import asyncio
from array import array

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from llmgw.config import ControlPlaneSettings
from llmgw.errors import ConfigError
from llmgw.kv.shard_views import ShardViews
from llmgw.protocol.kvstream import (
    KV_CONTENT_TYPE,
    KV_PATH,
    KvDeltaRequest,
    decode_kv_response,
    encode_kv_request,
)
from llmgw.protocol.sync import REGISTER_PATH, SYNC_PATH
from llmgw.serve.gateway_process import GatewayOptions, private_app, run_gateway
from llmgw.serve.servers import bind
from llmgw.store.database import create_engine, session_factory
from llmgw.store.instances import InstanceIdentity
from tests.controlplane.agentapi.agentapi_testkit import (
    FAST,
    make_token,
    place_shard,
    running_agent_api,
)
from tests.support.procs import free_port
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)


def test_workers_share_one_public_port_through_so_reuseport() -> None:
    first = bind("127.0.0.1", 0, listener="public", setting="gateway.port", reuse_port=True)
    try:
        port = first.getsockname()[1]
        second = bind("127.0.0.1", port, listener="public", setting="gateway.port", reuse_port=True)
        second.close()
        # Without it the port stays one process's: a second gateway is told what holds it.
        first.listen()
        with pytest.raises(ConfigError, match=r"gateway\.port"):
            bind("127.0.0.1", port, listener="public", setting="gateway.port").close()
    finally:
        first.close()


def test_a_listener_is_not_inherited_by_the_processes_it_starts() -> None:
    # A tokenizer worker exec'd by the gateway must not hold the listener: it outlives a
    # gateway killed with -9 by a moment, and clients' keep-alive and new connections to the
    # dead gateway then hang or reset instead of being refused (the fault suite saw it).
    sock = bind("127.0.0.1", 0, listener="public", setting="gateway.port", reuse_port=True)
    try:
        assert not sock.get_inheritable()
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("opts", "field"),
    [
        (GatewayOptions(workers=2, private_port=9999), "--private-port"),
        (GatewayOptions(workers=2, advertise_url="http://gw:1"), "--advertise-url"),
    ],
)
def test_several_workers_need_a_private_port_each(opts: GatewayOptions, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        run_gateway(None, {}, opts)
    assert err.value.field == field


async def test_the_private_listener_takes_kv_deltas_and_is_listed_to_agents(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions)
        node = await cp.node(token, "a")
        shard = await place_shard(cp.sessions, node.id, kv_events=True, model="llama")
        await cp.sync(node, seq=1)

        engine = create_engine(db_url, pool_size=2)
        port = free_port()
        identity = InstanceIdentity("gw-test", f"http://127.0.0.1:{port}")
        kv = ShardViews()
        app = private_app(
            ControlPlaneSettings(database_url=db_url, agent_api=FAST),
            sessions=session_factory(engine),
            registry=CollectorRegistry(),
            instance=identity,
            kv=kv,
        )
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on")
        )
        task = asyncio.create_task(server.serve())
        try:

            def started() -> bool:
                assert not task.done(), "the private listener stopped before it started"
                return bool(server.started)

            await until(started, timeout_s=20, what="the private listener to start")
            # The control plane lists the gateway's row to agents: they relay to it.
            live = await cp.api.instances.beat()
            assert identity.internal_url in {i.internal_url for i in live}
            body = encode_kv_request(
                KvDeltaRequest(shard_id=shard, base_version=0, new_version=1, reset=True,
                               block_size=16, added={"GPU": array("Q", [1, 2, 3])})
            )  # fmt: skip
            async with httpx.AsyncClient(base_url=identity.internal_url, timeout=10) as c:
                headers = {"Content-Type": KV_CONTENT_TYPE}
                r = await c.post(KV_PATH, content=body, headers={**headers, **node.auth})
                assert r.status_code == 200, r.text
                assert decode_kv_response(r.content) == "ack"
                assert kv.index.num_blocks(shard) == 3
                # The same credential check as the control plane's, before any body is read.
                r = await c.post(KV_PATH, content=body, headers=headers)
                assert r.status_code == 401
                assert (await c.get("/healthz")).json()["instance"] == "gw-test"
                assert "llmgw_agent_kv_requests_total" in (await c.get("/metrics")).text
                # Nothing else of the agent API, nor the admin API, answers here.
                for path in (SYNC_PATH, REGISTER_PATH, "/admin/v1/models"):
                    assert (await c.post(path, json={})).status_code in (404, 405), path
        finally:
            server.should_exit = True
            await task
            await engine.dispose()
        # Stopped: its row is gone, so agents stop relaying to it.
        live = await cp.api.instances.beat()
        assert identity.internal_url not in {i.internal_url for i in live}
