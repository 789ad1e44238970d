"""The agent's port allocators: ports kept across restarts unless something else took them;
each leader's front door from a range of its own."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llmgw.config import AgentSettings
from llmgw.errors import ConfigError
from llmgw.nodeagent.agent_validation import check_port_ranges
from llmgw.nodeagent.inventory.file import FileGpuSource, InventoryFile
from llmgw.nodeagent.launch import Launcher
from llmgw.nodeagent.ports import PortAllocator
from llmgw.nodeagent.prepare import prepare
from llmgw.nodeagent.records import ShardRecord
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.nodeagent.supervisor_config import SupervisorConfig
from tests.nodeagent.agent_harness import sim_shard
from tests.nodeagent.test_prepare_policy import REGISTRY, facts
from tests.support.procs import agent_port_base


def test_a_kept_port_is_renewed_only_when_another_process_holds_it() -> None:
    base = agent_port_base()
    ports = PortAllocator(base, base + 63)
    first = ports.allocate()
    assert ports.renew(first) == first  # the crashed engine freed it: kept
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first))
        squatter.listen()
        other = ports.renew(first)
        assert other != first and base <= other <= base + 63
    # The taken port went back to the pool; the new one is held.
    assert ports.allocate() not in (other,)


def _launcher(tmp: Path, engine_ports: tuple[int, int], door_ports: tuple[int, int]) -> Launcher:
    return Launcher(
        SupervisorConfig(
            shards_root=tmp,
            wrapper_argv=(),
            port_range=engine_ports,
            proxy_host="127.0.0.1",
            proxy_port_range=door_ports,
            proxy_metrics_token="scrape-token-0123456789",
        ),
        gpu_source=FileGpuSource(InventoryFile()),
        wrapper_env={},
        boot_id="boot",
    )


def test_a_leader_gets_a_front_door_port_of_its_own_range_kept_across_restarts(
    tmp_path: Path,
) -> None:
    base = agent_port_base()
    launcher = _launcher(tmp_path, (base, base + 47), (base + 48, base + 63))
    p = prepare(sim_shard("s"), REGISTRY, facts())
    first = launcher.build(p, tmp_path / "s", None, facts=facts())
    assert base + 48 <= first.proxy_port <= base + 63
    assert base <= first.ports.http_port <= base + 47
    door = launcher._front_door(first)
    assert door is not None
    assert (door.host, door.port, door.upstream_port) == (
        "127.0.0.1",
        first.proxy_port,
        first.ports.http_port,
    )
    assert (door.api_key, door.metrics_token) == (
        "engine-key-0123456789",
        "scrape-token-0123456789",
    )
    assert "engine-key" not in repr(door) and "scrape-token" not in repr(door)
    # The record keeps it; a restart reuses it while free (the gateways hold its URL) and
    # takes another when something else listens there.
    rec = ShardRecord(
        shard_id="s", digest=p.digest, spec={}, http_port=first.ports.http_port,
        proxy_port=first.proxy_port,
    )  # fmt: skip
    prev = ShardRuntime(shard_id="s", dir=tmp_path / "s", record=rec, phase="exited")
    assert launcher.build(p, tmp_path / "s", prev, facts=facts()).proxy_port == first.proxy_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first.proxy_port))
        squatter.listen()
        moved = launcher.build(p, tmp_path / "s", prev, facts=facts()).proxy_port
        assert moved != first.proxy_port and base + 48 <= moved <= base + 63
    # An adopting agent holds a recorded port: no other shard is given it.
    other = _launcher(tmp_path, (base, base + 47), (base + 48, base + 48 + 1))
    other.hold(rec.model_copy(update={"proxy_port": base + 48}))
    q = prepare(sim_shard("t"), REGISTRY, facts())
    assert other.build(q, tmp_path / "t", None, facts=facts()).proxy_port == base + 49


def test_no_front_door_without_a_key_to_check() -> None:
    base = agent_port_base()
    launcher = _launcher(Path("/nonexistent"), (base, base + 47), (base + 48, base + 63))
    keyless = sim_shard("s").model_copy(update={"engine_api_key": ""})
    pending = launcher.build(
        prepare(keyless, REGISTRY, facts()), Path("/nonexistent/s"), None, facts=facts()
    )
    assert pending.proxy_port == 0 and launcher._front_door(pending) is None


def test_front_door_and_engine_ranges_may_not_meet() -> None:
    check_port_ranges(AgentSettings())  # the defaults: 19000-19999 and 20000-29999
    overlapping = AgentSettings(proxy_port_range_start=29000, proxy_port_range_end=30999)
    with pytest.raises(ConfigError, match=r"overlaps agent\.port_range 20000-29999; move one"):
        check_port_ranges(overlapping)
