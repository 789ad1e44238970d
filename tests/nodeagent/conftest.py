"""Fixtures of the node agent's tests: the protocol test server, the REAL control plane
(`llmgw controlplane` on a throwaway database, ``realcp``), agents as real processes, and
shard ids whose processes are killed (by marker) whatever the test left behind."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmgw.nodeagent.procs import kill_marked
from tests.nodeagent.agent_harness import AgentProcess
from tests.nodeagent.protocol_server import ProtocolServer, protocol_server
from tests.nodeagent.realcp import RealControlPlane
from tests.pg_harness import PgServer
from tests.support.e2e_guard import spawns_processes
from tests.support.procs import agent_port_base, free_port


@pytest.fixture
def cp() -> Iterator[ProtocolServer]:
    with protocol_server(free_port()) as server:
        yield server


@pytest.fixture
@spawns_processes
def realcp(pg_server: PgServer, _pg_template: str, tmp_path: Path) -> Iterator[RealControlPlane]:
    name = pg_server.new_name("agentcp")
    db_url = pg_server.create_database(name, template=_pg_template)
    cp = RealControlPlane(db_url, tmp_path / "controlplane.log")
    try:
        yield cp.start()
    finally:
        cp.stop()
        pg_server.drop_database(name)


@pytest.fixture
def shard_ids() -> Iterator[Callable[[str], str]]:
    made: list[str] = []

    def make(prefix: str) -> str:
        sid = f"{prefix}-{uuid.uuid4().hex[:8]}"
        made.append(sid)
        return sid

    yield make
    for sid in made:
        kill_marked(sid)


@pytest.fixture
@spawns_processes
def agent_factory(tmp_path: Path, cp: ProtocolServer) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []
    base = agent_port_base()
    listen = free_port()
    state = tmp_path / "state"

    def make(**kw: object) -> AgentProcess:
        a = AgentProcess(
            state_dir=state,
            controlplane_url=cp.url,
            listen_port=listen,
            log_path=tmp_path / f"agent-{len(agents)}.log",
            port_range=(base, base + 63),
            **kw,  # type: ignore[arg-type]
        )
        agents.append(a)
        return a.start()

    yield make
    for a in agents:
        a.terminate()
