"""The agent's port allocator: ports kept across restarts unless something else took them."""

from __future__ import annotations

import socket

from support.procs import agent_port_base

from llmgw.nodeagent.ports import PortAllocator


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
