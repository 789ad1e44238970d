"""One listener's bounds (`ListenerLimits`: connections, the head's size and time) and the
descriptor arithmetic that fits every listener's connection cap into the process's limit
(`fit_connections`). Why each bound exists: ``llmgw.http.listeners``."""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from llmgw.logs import get_logger

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_HEADER_BYTES",
    "FD_RESERVE",
    "ListenerLimits",
    "fit_connections",
    "raise_fd_limit",
]

_log = get_logger("llmgw.http.listeners")

DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Descriptors every process keeps apart from its listeners' connections: log files, listening
# sockets, /proc reads, ZMQ sockets, DNS, the database's LISTEN connection. Callers add what
# they know they hold on top (database pools, upstream pools).
FD_RESERVE = 256
# No listener is cut below this by a small descriptor limit: a few connections must get in.
_MIN_CONNECTIONS = 16


class HeadSettings(Protocol):
    """A settings section that bounds its listener's request heads (each listener's has both)."""

    @property
    def max_header_bytes(self) -> int: ...

    @property
    def header_timeout_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """One listener's bounds, and the settings that set them (named in errors and logs)."""

    listener: str  # "public", "internal", "proxy", "agent-metrics", "simengine"
    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    connections_setting: str  # e.g. "gateway.max_connections"
    header_bytes_setting: str  # e.g. "gateway.max_header_bytes"
    # Descriptors one connection may hold: 2 for a proxy (the client's and the upstream's).
    fds_per_connection: int = 1

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_header_bytes < 1024 or self.header_timeout_s <= 0:
            raise ValueError(
                f"{self.listener} listener limits out of range: max_connections >= 1, "
                "max_header_bytes >= 1024 and header_timeout_s > 0 are required"
            )

    @classmethod
    def of(
        cls,
        listener: str,
        s: HeadSettings,
        *,
        section: str,
        connections: str = "max_connections",
    ) -> ListenerLimits:
        """``listener``'s bounds from the settings section ``s`` (``section`` in the files):
        its head bounds and the connection cap in its field ``connections``. The settings named
        in errors and logs are spelled from the fields read, so the two cannot drift apart."""
        return cls(
            listener=listener,
            max_connections=int(getattr(s, connections)),
            max_header_bytes=s.max_header_bytes,
            header_timeout_s=s.header_timeout_s,
            connections_setting=f"{section}.{connections}",
            header_bytes_setting=f"{section}.max_header_bytes",
        )


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard limit; returns the soft limit now
    in force. Linux's default soft limit (1024) is what ran the agent out of descriptors at a
    few hundred idle connections, while its hard limit was far above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit cannot be a soft one on Linux (fs.nr_open caps it): 2^20 is its
    # default there.
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return int(soft if soft != resource.RLIM_INFINITY else target)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        _log.warning("fd_limit_not_raised", soft=soft, hard=hard, error=str(exc))
        return int(soft)
    return int(target)


def fit_connections(limits: Sequence[ListenerLimits], *, reserve: int) -> list[ListenerLimits]:
    """``limits`` with each ``max_connections`` lowered, in proportion, so that all listeners'
    connections together plus ``reserve`` fit in the descriptor limit (raised first to the hard
    one): a listener that hit EMFILE would stop accepting, the health check included, and
    writes an error per failed accept."""
    fd_limit = raise_fd_limit()
    wanted = sum(lim.max_connections * lim.fds_per_connection for lim in limits)
    budget = fd_limit - reserve
    if wanted <= budget:
        return list(limits)
    share = max(budget, 0) / wanted
    fitted = [
        replace(lim, max_connections=max(_MIN_CONNECTIONS, int(lim.max_connections * share)))
        for lim in limits
    ]
    _log.warning(
        "connection_caps_lowered_to_fd_limit",
        fd_limit=fd_limit,
        reserve=reserve,
        caps={lim.listener: lim.max_connections for lim in fitted},
        hint="raise the descriptor hard limit (LimitNOFILE= in the systemd unit, ulimit -Hn) "
        "to serve the configured "
        + ", ".join(f"{lim.connections_setting}={lim.max_connections}" for lim in limits),
    )
    return fitted
