"""Fixtures of the node agent's tests: the protocol test server, agents as real processes,
and shard ids whose processes are killed (by marker) whatever the test left behind."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.procs import free_port

from llmgw.nodeagent.procs import kill_marked
from tests.nodeagent.agent_harness import AgentProcess
from tests.nodeagent.protocol_server import ProtocolServer, protocol_server


@pytest.fixture
def cp() -> Iterator[ProtocolServer]:
    with protocol_server(free_port()) as server:
        yield server


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
def agent_factory(tmp_path: Path, cp: ProtocolServer) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []
    base = random.randrange(30000, 60000, 64)
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
