"""Sync over real HTTP against a real Postgres (docs/architecture.md §5).

The ETag (unchanged vs changed), the desired set with its GPUs, report ordering by
(epoch, seq), own-shards-only in both directions, authentication before the body, the
released rule and confirmed_drain.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from llmgw.config import AgentApiSettings
from llmgw.engines import ShardSpec
from llmgw.protocol.sync import SYNC_PATH, ShardBinding
from tests.controlplane.agentapi.agentapi_testkit import (
    Node,
    fetch,
    make_token,
    place_shard,
    running_agent_api,
    set_desired_state,
)

pytestmark = pytest.mark.timeout(60)


def ready(shard: str, **kw: object) -> ShardBinding:
    return ShardBinding.model_validate(
        {"shard_id": shard, "observed_state": "ready", "http_port": 20001, "pid": 4242, **kw}
    )


async def _observed(cp: object, shard: str) -> tuple[str, int | None, str]:
    rows = await fetch(
        cp.sessions,  # type: ignore[attr-defined]
        "SELECT observed_state, pid, observed_reason FROM shards WHERE id = :id",
        id=shard,
    )
    return rows[0].observed_state, rows[0].pid, rows[0].observed_reason


async def test_the_desired_version_is_an_etag(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1", gpus=4)
        first = await cp.sync(node, seq=1)
        assert first.desired_version == "0" and not first.unchanged and first.shards == ()
        assert first.instance_id == "cp-test"
        assert [(i.id, i.internal_url) for i in first.instances] == [("cp-test", cp.base_url)]
        again = await cp.sync(node, seq=2, desired_version="0")
        assert again.unchanged and again.shards is None and again.desired_version == "0"

        # The reconciler places a shard on GPUs 3 and 1 (in that device order) and bumps.
        shard = await place_shard(cp.sessions, node.id, gpus=(3, 1), model="llama", api_key="k1")
        changed = await cp.sync(node, seq=3, desired_version="0")
        assert not changed.unchanged and changed.desired_version == "1"
        assert changed.shards is not None and len(changed.shards) == 1
        d = changed.shards[0]
        assert (d.shard_id, d.model, d.engine_api_key, d.desired_state) == (
            shard,
            "llama",
            "k1",
            "running",
        )
        assert "k1" not in repr(d)
        spec = ShardSpec.model_validate(d.spec)  # the agent can parse what it gets
        assert spec.gpu_indices == (3, 1) and spec.gpu_uuids == ()
        assert spec.shard_id == shard and spec.api_key == ""
        assert (await cp.sync(node, seq=4, desired_version="1")).unchanged


async def test_mig_slices_travel_as_uuids_in_device_order(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        await place_shard(cp.sessions, node.id, gpus=((0, "MIG-aaaa"),))
        resp = await cp.sync(node, seq=1)
        assert resp.shards is not None
        spec = ShardSpec.model_validate(resp.shards[0].spec)
        assert spec.gpu_indices == (0,) and spec.gpu_uuids == ("MIG-aaaa",)


async def test_an_older_report_never_overwrites_a_newer_one(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        shard = await place_shard(cp.sessions, node.id)
        await cp.sync(node, epoch=5, seq=10, bindings=[ready(shard)])
        assert await _observed(cp, shard) == ("ready", 4242, "")
        # A delayed request of the same run, and one of the previous run: answered, not applied.
        for epoch, seq in ((5, 9), (5, 10), (4, 99)):
            late = ShardBinding(shard_id=shard, observed_state="failed", reason=f"{epoch}/{seq}")
            resp = await cp.sync(node, epoch=epoch, seq=seq, desired_version="1", bindings=[late])
            assert resp.desired_version == "1"
            assert await _observed(cp, shard) == ("ready", 4242, "")
        status = await fetch(cp.sessions, "SELECT agent_epoch, agent_seq FROM node_status")
        assert (status[0].agent_epoch, status[0].agent_seq) == (5, 10)
        # A new agent run (higher epoch) starts again at seq 0 and is applied.
        restarted = ShardBinding(shard_id=shard, observed_state="starting", pid=777)
        await cp.sync(node, epoch=6, seq=0, desired_version="1", bindings=[restarted])
        assert await _observed(cp, shard) == ("starting", 777, "")
        status = await fetch(cp.sessions, "SELECT agent_epoch, agent_seq FROM node_status")
        assert (status[0].agent_epoch, status[0].agent_seq) == (6, 0)
        assert cp.metric("llmgw_agent_syncs_total", {"result": "stale"}) == 3


async def test_a_node_reads_and_writes_only_its_own_shards(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions)
        a, b = await cp.node(token, "a"), await cp.node(token, "b")
        shard_a = await place_shard(cp.sessions, a.id)
        await cp.sync(a, seq=1, bindings=[ready(shard_a)])
        # b reports on a's shard (and on one that does not exist): ignored and counted.
        bogus = ShardBinding(shard_id=shard_a, observed_state="failed", reason="b says so")
        unknown = ready(str(uuid.uuid4()))
        resp = await cp.sync(b, seq=1, bindings=[bogus, unknown, ready("not-a-uuid")])
        assert resp.shards == ()  # b receives nothing of a's
        assert await _observed(cp, shard_a) == ("ready", 4242, "")
        assert cp.metric("llmgw_agent_foreign_bindings_total") == 3
        # ...and a confirmed drain is not claimed for engines the control plane does not know.
        assert not resp.confirmed_drain
        # b cannot sync as a, even with a's id in the body.
        r = await cp.sync_raw(b, seq=2, node_id=a.id)
        assert r.status_code == 409 and r.json()["code"] == "conflict"


async def test_bad_credentials_are_refused_before_the_body_and_write_nothing(
    db_url: str,
) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions)
        node = await cp.node(token, "n1")
        shard = await place_shard(cp.sessions, node.id)
        before = await fetch(cp.sessions, "SELECT * FROM node_status")
        secret = node.credential.split("_", 2)[2]
        wrong = Node(node.id, node.credential[:-4] + "AAAA", "n1")
        cases = {
            "wrong secret": wrong.auth,
            "no header": {},
            "basic auth": {"Authorization": "Basic dXNlcjpwYXNz"},
            "unknown node": {"Authorization": f"Bearer llmgwn_{uuid.uuid4()}_{secret}"},
        }
        for why, headers in cases.items():
            r = await cp.sync_raw(node, seq=5, bindings=[ready(shard)], headers=headers)
            assert r.status_code == 401, why
            assert r.json()["code"] == "unauthorized" and secret not in r.text
            assert r.headers["www-authenticate"] == "Bearer"
        # Authentication comes before the body: an anonymous oversize body is a 401, not a 413.
        huge = b"x" * (cp.api.settings.sync_max_body_bytes + 1)
        r = await cp.client.post(SYNC_PATH, content=huge, headers=wrong.auth)
        assert r.status_code == 401
        r = await cp.client.post(SYNC_PATH, content=huge, headers=node.auth)
        assert r.status_code == 413
        assert await fetch(cp.sessions, "SELECT * FROM node_status") == before
        assert await _observed(cp, shard) == ("pending", None, "")

        # Revoked: the node's credential replaced (re-registration after an admin delete does
        # the same); the cached copy must not let the old one through.
        await cp.sync(node, seq=1)
        await fetch(cp.sessions, "UPDATE nodes SET credential_hash = sha256('other') RETURNING id")
        r = await cp.sync_raw(node, seq=2, bindings=[ready(shard)])
        assert r.status_code == 401
        assert await _observed(cp, shard) == ("pending", None, "")


async def test_a_stopped_shard_is_released_once_its_agent_reports_it_gone(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1", gpus=4)
        keep = await place_shard(cp.sessions, node.id, gpus=(0,))
        exits = await place_shard(cp.sessions, node.id, gpus=(1,))
        vanishes = await place_shard(cp.sessions, node.id, gpus=(2,))
        resp = await cp.sync(node, seq=1, bindings=[ready(keep), ready(exits), ready(vanishes)])
        assert resp.desired_version == "3"
        await set_desired_state(cp.sessions, exits, "stopped")
        await set_desired_state(cp.sessions, vanishes, "stopped")
        # Still running (the agent has not acted yet): nothing is released.
        resp = await cp.sync(
            node, seq=2, desired_version="3", bindings=[ready(keep), ready(exits), ready(vanishes)]
        )
        assert resp.desired_version == "5"
        assert resp.shards is not None
        assert {s.shard_id: s.desired_state for s in resp.shards} == {
            keep: "running",
            exits: "stopped",
            vanishes: "stopped",
        }
        # Every engine it runs is one the control plane knows: the stops are deliberate.
        assert resp.confirmed_drain
        # The agent stopped one (reports it exited) and forgot the other (does not report it).
        gone = ShardBinding(shard_id=exits, observed_state="exited", exit_code=0)
        resp = await cp.sync(node, seq=3, desired_version="5", bindings=[ready(keep), gone])
        assert resp.desired_version == "6"  # bumped once for both
        assert resp.shards is not None and [s.shard_id for s in resp.shards] == [keep]
        released = await fetch(
            cp.sessions, "SELECT id, released, observed_state FROM shards ORDER BY id"
        )
        assert {str(r.id): r.released for r in released} == {
            keep: False,
            exits: True,
            vanishes: True,
        }
        gpus = await fetch(
            cp.sessions, "SELECT gpu_index, shard_released FROM gpu_assignments ORDER BY 1"
        )
        assert [tuple(g) for g in gpus] == [(0, False), (1, True), (2, True)]
        assert cp.metric("llmgw_agent_shards_released_total") == 2
        # Their GPUs can be placed again at once.
        again = await place_shard(cp.sessions, node.id, gpus=(1, 2))
        resp = await cp.sync(node, seq=4, desired_version="6", bindings=[ready(keep)])
        assert resp.shards is not None and {s.shard_id for s in resp.shards} == {keep, again}


async def test_an_agent_on_an_older_set_releases_nothing(db_url: str) -> None:
    """`exited` from an agent that has not applied the stop is a crash with a restart pending:
    freeing its GPUs then would let the reconciler place them twice."""
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1", gpus=2)
        shard = await place_shard(cp.sessions, node.id, gpus=(0,))
        resp = await cp.sync(node, seq=1, bindings=[ready(shard)])
        current = resp.desired_version
        await set_desired_state(cp.sessions, shard, "stopped")
        crashed = ShardBinding(shard_id=shard, observed_state="exited", exit_code=137)
        resp = await cp.sync(node, seq=2, desired_version=current, bindings=[crashed])
        rows = await fetch(cp.sessions, "SELECT released FROM shards")
        assert rows[0].released is False
        # Once it reports on the set that stops the shard, the shard is released.
        resp = await cp.sync(node, seq=3, desired_version=resp.desired_version, bindings=[])
        rows = await fetch(cp.sessions, "SELECT released FROM shards")
        assert rows[0].released is True


async def test_a_running_shard_missing_from_the_report_is_not_released(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        shard = await place_shard(cp.sessions, node.id)
        resp = await cp.sync(node, seq=1, bindings=[])
        assert resp.shards is not None and [s.shard_id for s in resp.shards] == [shard]
        rows = await fetch(cp.sessions, "SELECT released FROM shards")
        assert rows[0].released is False


async def test_confirmed_drain_follows_the_admins_drain(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        stranger = ready(str(uuid.uuid4()))
        resp = await cp.sync(node, seq=1, bindings=[stranger])
        assert not resp.confirmed_drain
        await fetch(cp.sessions, "UPDATE nodes SET draining = true RETURNING id")
        resp = await cp.sync(node, seq=2, desired_version="0", bindings=[stranger])
        assert resp.unchanged and resp.confirmed_drain


async def test_cached_node_rows_lag_by_at_most_the_refresh(db_url: str) -> None:
    """Default mode: unchanged syncs are answered from the node table in memory; a change the
    reconciler made shows within node_refresh_s, a replaced credential is refused at once by
    any sync that writes and within node_refresh_s by unchanged ones."""
    settings = AgentApiSettings(node_refresh_s=0.3, heartbeat_flush_s=0.2)
    async with running_agent_api(db_url, settings=settings) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        assert (await cp.sync(node, seq=1)).desired_version == "0"
        shard = await place_shard(cp.sessions, node.id)
        seq = 1
        deadline = time.monotonic() + 10
        while True:
            seq += 1
            resp = await cp.sync(node, seq=seq, desired_version="0")
            if not resp.unchanged:
                break
            assert time.monotonic() < deadline, "the new desired set never reached the agent"
            await asyncio.sleep(0.05)
        assert resp.shards is not None and [s.shard_id for s in resp.shards] == [shard]

        await fetch(cp.sessions, "UPDATE nodes SET credential_hash = sha256('x') RETURNING id")
        seq += 1
        r = await cp.sync_raw(node, seq=seq, desired_version="1", bindings=[ready(shard)])
        assert r.status_code == 401  # a sync that would write re-reads the row
        assert await _observed(cp, shard) == ("pending", None, "")
        deadline = time.monotonic() + 10
        while (await cp.sync_raw(node, seq=seq + 1, desired_version="1")).status_code != 401:
            assert time.monotonic() < deadline, "a replaced credential was never refused"
            seq += 1
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("node_refresh_s", [0.0, 30.0])
async def test_a_report_another_instance_wrote_since_is_never_skipped(
    db_url: str, node_refresh_s: float
) -> None:
    """Instance one applied bindings B1, instance two then applied B2 for the same node; when
    the agent reports B1 again to instance one, that is a change (the row holds B2), even
    though B1 is what instance one last applied. Detected by the stored (epoch, seq) being
    past what instance one knows: read fresh (node_refresh_s=0) or from the node table once
    it was refreshed in between (which node_refresh_s below the agents' sync interval
    guarantees; here the refresh is called explicitly)."""
    settings = AgentApiSettings(node_refresh_s=node_refresh_s, heartbeat_flush_s=0.2)
    async with (
        running_agent_api(db_url, settings=settings, instance_id="one") as one,
        running_agent_api(db_url, settings=settings, instance_id="two") as two,
    ):
        node = await one.node(await make_token(one.sessions), "n1")
        shard = await place_shard(one.sessions, node.id)
        b1 = [ready(shard, pid=1)]
        b2 = [ready(shard, pid=2)]
        await one.sync(node, seq=1, bindings=b1)
        assert (await one.sync(node, seq=2, desired_version="1", bindings=b1)).unchanged
        await two.sync(node, seq=3, desired_version="1", bindings=b2)
        assert await _observed(one, shard) == ("ready", 2, "")
        await one.api.nodes.refresh()
        await one.sync(node, seq=4, desired_version="1", bindings=b1)
        assert await _observed(one, shard) == ("ready", 1, "")


async def test_stopped_shards_that_go_one_sync_apart_are_both_released(db_url: str) -> None:
    """A node stopping two shards reports the first gone while the second still drains; the
    second must be released once it is gone too, though the first release bumped the set."""
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1", gpus=3)
        keep = await place_shard(cp.sessions, node.id, gpus=(0,))
        first = await place_shard(cp.sessions, node.id, gpus=(1,))
        second = await place_shard(cp.sessions, node.id, gpus=(2,))
        resp = await cp.sync(node, seq=1, bindings=[ready(keep), ready(first), ready(second)])
        await set_desired_state(cp.sessions, first, "stopped")
        await set_desired_state(cp.sessions, second, "stopped")
        draining = ShardBinding(shard_id=second, observed_state="draining")
        resp = await cp.sync(
            node,
            seq=2,
            desired_version=resp.desired_version,
            bindings=[ready(keep), ready(first), ready(second)],
        )
        # The agent applies the set that stops both: the first is gone, the second drains.
        resp = await cp.sync(
            node, seq=3, desired_version=resp.desired_version, bindings=[ready(keep), draining]
        )
        resp = await cp.sync(
            node, seq=4, desired_version=resp.desired_version, bindings=[ready(keep), draining]
        )
        resp = await cp.sync(
            node, seq=5, desired_version=resp.desired_version, bindings=[ready(keep)]
        )
        rows = await fetch(cp.sessions, "SELECT id, released FROM shards ORDER BY id")
        assert {str(r.id): r.released for r in rows} == {keep: False, first: True, second: True}


async def test_a_shard_gone_while_its_agent_was_behind_is_released_on_a_later_report(
    db_url: str,
) -> None:
    """The reconciler bumps the node's set (another replica deleted) between the agent's
    reports: the report that first shows the shard gone comes from an older set and releases
    nothing; the same report on the current set must, though nothing in it changed."""
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1", gpus=2)
        keep = await place_shard(cp.sessions, node.id, gpus=(0,))
        gone = await place_shard(cp.sessions, node.id, gpus=(1,))
        resp = await cp.sync(node, seq=1, bindings=[ready(keep), ready(gone)])
        await set_desired_state(cp.sessions, gone, "stopped")
        resp = await cp.sync(
            node, seq=2, desired_version=resp.desired_version, bindings=[ready(keep), ready(gone)]
        )
        current = resp.desired_version
        await set_desired_state(cp.sessions, keep, "running")  # a bump, as DeleteReplica does
        # Gone, reported on the set before the bump: nothing released yet.
        resp = await cp.sync(node, seq=3, desired_version=current, bindings=[ready(keep)])
        rows = await fetch(cp.sessions, "SELECT released FROM shards WHERE id = :id", id=gone)
        assert rows[0].released is False
        # The same report on the current set releases it.
        await cp.sync(node, seq=4, desired_version=resp.desired_version, bindings=[ready(keep)])
        rows = await fetch(cp.sessions, "SELECT released FROM shards WHERE id = :id", id=gone)
        assert rows[0].released is True
