"""Registration over real HTTP against a real Postgres: the happy path and every refusal.

Each refusal is checked to have written nothing: no node, no status row, no use of the token.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.errors import SpecError
from llmgw.protocol.sync import REGISTER_PATH, RegisterRequest, RegisterResponse
from llmgw.store.bootstrap_tokens import create_bootstrap_token
from llmgw.store.credentials import parse_node_credential
from tests.controlplane.agentapi.agentapi_testkit import (
    Node,
    count,
    fetch,
    make_token,
    place_shard,
    running_agent_api,
    sim_inventory,
)

pytestmark = pytest.mark.timeout(60)


def _body(token: str, name: str = "n1") -> bytes:
    return (
        RegisterRequest(
            bootstrap_token=token,
            node_name=name,
            mgmt_addr="10.0.0.7",
            inventory=sim_inventory(2),
            agent_version="0.1",
        )
        .model_dump_json()
        .encode()
    )


async def _nothing_written(
    sessions: async_sessionmaker[AsyncSession], uses_before: list[object], token_id: str
) -> None:
    assert await count(sessions, "nodes") == 0
    assert await count(sessions, "node_status") == 0
    rows = await fetch(sessions, "SELECT uses_left FROM bootstrap_tokens WHERE id = :i", i=token_id)
    assert [r[0] for r in rows] == uses_before


async def test_register_creates_the_node_in_the_tokens_pool(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions, pool="batch", uses=2)
        token_id = token.split("_")[1]
        r = await cp.client.post(REGISTER_PATH, content=_body(token, "gpu-7"))
        assert r.status_code == 200, r.text
        got = RegisterResponse.model_validate_json(r.content)
        assert got.approval_state == "approved"
        cluster = await fetch(cp.sessions, "SELECT cluster_id FROM cluster_info")
        assert got.cluster_id == str(cluster[0][0])
        cred = parse_node_credential(got.node_credential)
        assert cred is not None and str(cred.node_id) == got.node_id
        node = await fetch(
            cp.sessions,
            "SELECT name, pool, approval_state, credential_hash, bootstrap_token_id FROM nodes",
        )
        assert [(n.name, n.pool, n.approval_state, n.bootstrap_token_id) for n in node] == [
            ("gpu-7", "batch", "approved", token_id)
        ]
        # Only the hash is stored.
        assert bytes(node[0].credential_hash) == hashlib.sha256(cred.secret.encode()).digest()
        status = await fetch(
            cp.sessions, "SELECT mgmt_addr, inventory, agent_version FROM node_status"
        )
        assert status[0].mgmt_addr == "10.0.0.7"
        assert [g["index"] for g in status[0].inventory["gpus"]] == [0, 1]
        assert status[0].agent_version == "0.1"
        uses = await fetch(cp.sessions, "SELECT uses_left FROM bootstrap_tokens")
        assert uses[0][0] == 1
        # The secret is nowhere in the database in the clear.
        dump = await fetch(cp.sessions, "SELECT row_to_json(n)::text FROM nodes n")
        assert cred.secret not in dump[0][0]
        assert cp.metric("llmgw_agent_registrations_total", {"result": "ok"}) == 1


async def test_every_bad_token_is_refused_with_401_and_writes_nothing(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        good = await make_token(cp.sessions, uses=5)
        good_id = good.split("_")[1]
        expired = await make_token(cp.sessions, uses=5)
        await fetch(
            cp.sessions,
            "UPDATE bootstrap_tokens SET expires_at = now() - interval '1 s' WHERE id = :i "
            "RETURNING id",
            i=expired.split("_")[1],
        )
        revoked = await make_token(cp.sessions)
        await fetch(
            cp.sessions,
            "UPDATE bootstrap_tokens SET revoked = true WHERE id = :i RETURNING id",
            i=revoked.split("_")[1],
        )
        used_up = await make_token(cp.sessions, uses=1)
        await fetch(
            cp.sessions,
            "UPDATE bootstrap_tokens SET uses_left = 0 WHERE id = :i RETURNING id",
            i=used_up.split("_")[1],
        )
        head, _, secret = good.rpartition("_")
        bad = {
            "wrong secret": f"{head}_{'x' * len(secret)}",
            "unknown id": f"llmgwb_{'0' * 16}_{secret}",
            "malformed": "not-a-token",
            "node credential shape": f"llmgwn_{uuid.uuid4()}_{secret}",
            "expired": expired,
            "revoked": revoked,
            "used up": used_up,
        }
        for why, token in bad.items():
            r = await cp.client.post(REGISTER_PATH, content=_body(token))
            assert r.status_code == 401, (why, r.text)
            assert r.json()["code"] == "unauthorized"
            assert secret not in r.text and "llmgwb_" not in r.text
            await _nothing_written(cp.sessions, [5], good_id)
        # The good one still works afterwards.
        r = await cp.client.post(REGISTER_PATH, content=_body(good))
        assert r.status_code == 200


async def test_a_token_with_one_use_registers_one_node(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions, uses=1)
        assert (await cp.client.post(REGISTER_PATH, content=_body(token, "a"))).status_code == 200
        r = await cp.client.post(REGISTER_PATH, content=_body(token, "b"))
        assert r.status_code == 401
        assert [r.name for r in await fetch(cp.sessions, "SELECT name FROM nodes")] == ["a"]


async def test_a_registered_name_is_refused_with_409_and_the_use_is_kept(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions, uses=3)
        assert (await cp.client.post(REGISTER_PATH, content=_body(token, "a"))).status_code == 200
        nodes_before = await fetch(cp.sessions, "SELECT id, credential_hash FROM nodes")
        r = await cp.client.post(REGISTER_PATH, content=_body(token, "a"))
        assert r.status_code == 409
        assert r.json()["code"] == "conflict"
        assert "deletes the node first" in r.json()["message"]
        assert await fetch(cp.sessions, "SELECT id, credential_hash FROM nodes") == nodes_before
        uses = await fetch(cp.sessions, "SELECT uses_left FROM bootstrap_tokens")
        assert uses[0][0] == 2  # the refused registration's use was rolled back


async def test_an_admin_created_node_without_credential_is_claimed(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions, require_approval=True)
        rows = await fetch(
            cp.sessions,
            "INSERT INTO nodes (name, approval_state, labels) VALUES ('pre', 'approved', "
            '\'{"rack": "r1"}\') RETURNING id',
        )
        got = await cp.register(token, "pre")
        assert isinstance(got, RegisterResponse)
        assert got.node_id == str(rows[0][0])
        assert got.approval_state == "approved"  # an admin's approval is kept
        labels = await fetch(cp.sessions, "SELECT labels FROM nodes")
        assert labels[0][0] == {"rack": "r1"}
        node = Node(got.node_id, got.node_credential, "pre")
        assert (await cp.sync(node, seq=1)).approval_state == "approved"


async def test_oversize_and_malformed_bodies_are_refused_before_anything_is_written(
    db_url: str,
) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions, uses=5)
        token_id = token.split("_")[1]
        cap = cp.api.settings.register_max_body_bytes
        big = b'{"pad": "' + b"x" * cap + b'"}'
        r = await cp.client.post(REGISTER_PATH, content=big)
        assert r.status_code == 413 and r.json()["code"] == "body-too-large"

        # Without Content-Length (chunked): cut off while reading, not after.
        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(cap // 65536 + 4):
                yield b"x" * 65536

        r = await cp.client.post(REGISTER_PATH, content=chunks())
        assert r.status_code == 413
        r = await cp.client.post(REGISTER_PATH, content=b"{not json")
        assert r.status_code == 400 and r.json()["code"] == "malformed-json"
        r = await cp.client.post(REGISTER_PATH, content=b'{"bootstrap_token": "llmgwb_a_b"}')
        assert r.status_code == 422 and r.json()["code"] == "spec-invalid"
        assert "llmgwb_a_b" not in r.text
        newer = _body(token).replace(b'"protocol_version":1', b'"protocol_version":2')
        r = await cp.client.post(REGISTER_PATH, content=newer)
        assert r.status_code == 426 and r.json()["code"] == "protocol-version"
        # A newer agent whose body this version cannot parse still hears "version", not 422.
        r = await cp.client.post(REGISTER_PATH, content=b'{"protocol_version": 3, "x": 1}')
        assert r.status_code == 426
        await _nothing_written(cp.sessions, [5], token_id)


async def test_approval_required_makes_the_node_pending_until_approved(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions, require_approval=True)
        got = await cp.register(token, "p1")
        assert isinstance(got, RegisterResponse) and got.approval_state == "pending"
        node = Node(got.node_id, got.node_credential, "p1")
        await place_shard(cp.sessions, node.id)
        resp = await cp.sync(node, seq=1, inventory=sim_inventory(4))
        assert resp.approval_state == "pending"
        assert resp.shards is None and resp.desired_version is None and not resp.unchanged
        # Its inventory is stored for the admin deciding on it.
        inv = await fetch(cp.sessions, "SELECT inventory FROM node_status")
        assert len(inv[0][0]["gpus"]) == 4
        await fetch(cp.sessions, "UPDATE nodes SET approval_state = 'approved' RETURNING id")
        resp = await cp.sync(node, seq=2)
        assert resp.approval_state == "approved"
        assert resp.shards is not None and len(resp.shards) == 1


async def test_create_bootstrap_token_refuses_what_cannot_be_meant(db_url: str) -> None:
    from llmgw.store.database import create_engine, session_factory

    engine = create_engine(db_url, pool_size=1)
    try:
        async with session_factory(engine)() as session, session.begin():
            with pytest.raises(SpecError, match="ttl_s"):
                await create_bootstrap_token(session, ttl_s=0, uses=1)
            with pytest.raises(SpecError, match="uses"):
                await create_bootstrap_token(session, ttl_s=60, uses=0)
            row, plaintext = await create_bootstrap_token(session, ttl_s=60, uses=None)
            assert plaintext.startswith(f"llmgwb_{row.id}_")
            secret = plaintext.split("_", 2)[2]
            assert row.secret_sha256 == hashlib.sha256(secret.encode()).digest()
            assert plaintext not in repr(row.__dict__)
    finally:
        await engine.dispose()
