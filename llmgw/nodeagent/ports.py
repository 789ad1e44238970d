"""Ports for shards from the node's configured range, kept with each shard across restarts.

A shard keeps its ports for its life on the node (they are in its record):
an adopted engine still listens, and still publishes KV events, where it
did before the agent restarted, and a restarted engine's KV PUB meets the
agent's SUB on the same port. The agent runs two allocators: one for what
listens on loopback (engines, KV sockets: agent.port_range_*), one for the
shards' front doors on the management address (agent.proxy_port_range_*),
so that one firewall rule opens exactly what gateways and Prometheus reach.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable

__all__ = ["PortAllocator", "PortsExhausted"]


class PortsExhausted(Exception):
    """No free port is left in the configured range."""


def _bindable(port: int, *, host: str = "127.0.0.1", reuse_addr: bool = False) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if reuse_addr:
            # As the engines' servers bind: connections of a dead engine lingering in
            # TIME_WAIT do not make its port unusable, only a live listener does.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortAllocator:
    def __init__(
        self, start: int, end: int, *, host: str = "127.0.0.1", setting: str = "agent.port_range"
    ) -> None:
        self._start = start
        self._end = end
        # Where the ports' users bind: a port free on loopback may be taken on another address.
        self._host = host
        self._setting = setting
        self._held: set[int] = set()
        # From a random place in the range, then in turn: two allocators over one range (two
        # `llmgw up`s on a machine, an agent beside a test run) would otherwise both offer its
        # first free port and race to bind it, and the loser's shard fails its first start.
        self._next = start + random.randrange(end - start + 1) if end >= start else start

    def hold(self, ports: Iterable[int]) -> None:
        """Mark ports in use (by a recovered record), whether or not in the range."""
        self._held.update(p for p in ports if p > 0)

    def release(self, ports: Iterable[int]) -> None:
        self._held.difference_update(ports)

    def renew(self, port: int) -> int:
        """``port`` again if nothing is bound to it, else a fresh one (``port`` released).

        For an engine's own listeners on a restart: a crashed engine freed them, but another
        process may have taken one since, and an engine started there would crash-loop on
        "address already in use" for as long as that process holds it.
        """
        if _bindable(port, host=self._host, reuse_addr=True):
            return port
        self.release([port])
        return self.allocate()

    def allocate(self) -> int:
        """A port no shard holds and nothing is bound to now; PortsExhausted when none is."""
        size = self._end - self._start + 1
        for _ in range(size):
            port = self._next
            self._next = self._start + (self._next - self._start + 1) % size
            if port in self._held or not _bindable(port, host=self._host):
                continue
            self._held.add(port)
            return port
        raise PortsExhausted(
            f"no free port in {self._setting} {self._start}-{self._end} "
            f"({len(self._held)} held by shards); widen the range"
        )
