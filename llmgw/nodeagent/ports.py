"""Ports for shards from the node's configured range, kept with each shard across restarts.

A shard keeps its ports for its life on the node (they are in its record):
an adopted engine still listens, and still publishes KV events, where it
did before the agent restarted, and a restarted engine's KV PUB meets the
agent's SUB on the same port.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

__all__ = ["PortAllocator", "PortsExhausted"]


class PortsExhausted(Exception):
    """No free port is left in the configured range."""


def _bindable(port: int, *, reuse_addr: bool = False) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse_addr:
            # As the engines' servers bind: connections of a dead engine lingering in
            # TIME_WAIT do not make its port unusable, only a live listener does.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortAllocator:
    def __init__(self, start: int, end: int) -> None:
        self._start = start
        self._end = end
        self._held: set[int] = set()
        self._next = start

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
        if _bindable(port, reuse_addr=True):
            return port
        self.release([port])
        return self.allocate()

    def allocate(self) -> int:
        """A port no shard holds and nothing is bound to now; PortsExhausted when none is."""
        size = self._end - self._start + 1
        for _ in range(size):
            port = self._next
            self._next = self._start + (self._next - self._start + 1) % size
            if port in self._held or not _bindable(port):
                continue
            self._held.add(port)
            return port
        raise PortsExhausted(
            f"no free port in agent.port_range {self._start}-{self._end} "
            f"({len(self._held)} held by shards); widen the range"
        )
