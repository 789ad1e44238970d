"""controlplane_instances: registration, the live window and removal, against a real Postgres."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from llmgw.controlplane.instances import InstanceHeartbeat, InstanceIdentity, new_instance_id
from llmgw.store.database import create_engine, session_factory
from llmgw.store.instances import (
    list_live_instances,
    remove_instance,
    upsert_instance,
)

pytestmark = pytest.mark.timeout(60)


async def test_live_instances_are_those_seen_within_the_window(db_url: str) -> None:
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        a = InstanceIdentity("a", "http://10.0.0.1:8081")
        b = InstanceIdentity("b", "http://10.0.0.2:8081")
        async with sessions() as s, s.begin():
            await upsert_instance(s, a)
            await upsert_instance(s, b)
            await upsert_instance(s, InstanceIdentity("a", "http://10.0.0.9:8081"))  # moved
        async with sessions() as s, s.begin():
            live = await list_live_instances(s, within_s=9)
        assert [(i.id, i.internal_url) for i in live] == [
            ("a", "http://10.0.0.9:8081"),
            ("b", "http://10.0.0.2:8081"),
        ]
        async with sessions() as s, s.begin():
            await s.execute(
                text(
                    "UPDATE controlplane_instances SET last_seen_at = now() - interval '10 s' "
                    "WHERE id = 'b'"
                )
            )
            assert [i.id for i in await list_live_instances(s, within_s=9)] == ["a"]
            await remove_instance(s, "a")
            assert await list_live_instances(s, within_s=9) == ()

        # The shell: registers at start, lists itself, removes its row at stop.
        beat = InstanceHeartbeat(sessions, InstanceIdentity(new_instance_id(), "http://x:1"))
        await beat.start()
        assert [i.id for i in beat.live] == [beat.identity.id]
        await beat.stop()
        async with sessions() as s, s.begin():
            ids = (await s.execute(text("SELECT id FROM controlplane_instances"))).scalars()
            assert list(ids) == ["b"]
    finally:
        await engine.dispose()
