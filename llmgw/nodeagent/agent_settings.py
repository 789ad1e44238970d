"""What the agent's parts are configured with, derived from its settings (AgentSettings): the
engines' config, the local policy, the supervisor's config, and the bounds of the agent's own
listeners fitted to the descriptor limit.

Translation only: no checks (agent_validation.py refuses a bad config), nothing started; the
one side effect is fitting the listeners, which raises the descriptor limit to the hard one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmgw.config import AgentSettings
from llmgw.engines import EnginesConfig, SimConfig
from llmgw.http.listeners import FD_RESERVE, ListenerLimits, fit_connections
from llmgw.nodeagent.adapter_sync import AdapterSyncConfig
from llmgw.nodeagent.policy import LocalPolicy
from llmgw.nodeagent.proxy import proxy_limits
from llmgw.nodeagent.supervisor_config import SupervisorConfig
from llmgw.protocol import MAX_SHARDS

__all__ = [
    "adapter_sync_config",
    "engines_config",
    "listener_limits",
    "local_policy",
    "supervisor_config",
]

# Descriptors kept apart from the listeners' connections: per shard its ZMQ sockets, health
# checks, and the log and record files the supervisor reads; /proc reads on top.
_FD_RESERVE = FD_RESERVE + 8 * MAX_SHARDS


def engines_config(s: AgentSettings) -> EnginesConfig:
    cfg = EnginesConfig.model_validate(s.engines)
    if cfg.sim.python_executable == SimConfig().python_executable:
        # The simulator runs the same llmgw as the agent.
        cfg = cfg.model_copy(update={"sim": SimConfig(python_executable=sys.executable)})
    return cfg


def local_policy(s: AgentSettings) -> LocalPolicy:
    return LocalPolicy(
        allowed_model_roots=tuple(s.policy.allowed_model_roots),
        allowed_engines=tuple(s.policy.allowed_engines),
        refused_flags=tuple(s.policy.refused_flags),
        allowed_adapter_sources=tuple(s.policy.allowed_adapter_sources),
    )


def supervisor_config(
    s: AgentSettings, *, state_root: Path, shards_root: Path, proxy_host: str, metrics_token: str
) -> SupervisorConfig:
    """``proxy_host``: where the front doors listen (the management address)."""
    return SupervisorConfig(
        shards_root=shards_root,
        wrapper_argv=(sys.executable, "-m", "llmgw", "shard-run"),
        port_range=(s.port_range_start, s.port_range_end),
        proxy_host=proxy_host,
        proxy_port_range=(s.proxy_port_range_start, s.proxy_port_range_end),
        proxy_metrics_token=metrics_token,
        proxy_max_connections=s.proxy_max_connections,
        max_header_bytes=s.max_header_bytes,
        header_timeout_s=s.header_timeout_s,
        stop_grace_s=s.stop_grace_s,
        start_timeout_s=s.start_timeout_s,
        restart_backoff_min_s=s.restart_backoff_min_s,
        restart_backoff_max_s=s.restart_backoff_max_s,
        crash_loop_after=s.crash_loop_after,
        stable_after_s=s.stable_after_s,
        log_max_bytes=s.log_max_bytes,
        log_backups=s.log_backups,
        adapter_root=state_root / "adapters",
        adapter_max_bytes=s.policy.adapter_max_bytes,
        adapter_allow_loopback=s.policy.adapter_fetch_allow_loopback,
    )


def adapter_sync_config(s: AgentSettings, *, state_root: Path) -> AdapterSyncConfig:
    """Runtime adapters: downloads beside the profiles' (one copy per source), the same caps."""
    return AdapterSyncConfig(
        adapter_root=state_root / "adapters",
        adapter_max_bytes=s.policy.adapter_max_bytes,
        adapter_allow_loopback=s.policy.adapter_fetch_allow_loopback,
        call_timeout_s=s.adapter_call_timeout_s,
        retry_min_s=s.adapter_retry_min_s,
        retry_max_s=s.adapter_retry_max_s,
    )


def listener_limits(s: AgentSettings) -> tuple[ListenerLimits, ListenerLimits]:
    """The shared proxy's and the /healthz listener's bounds, their caps fitted to the
    descriptor limit (raised to the hard one): an agent that ran out of descriptors failed its
    supervisor passes too (`too many open files` reading /proc)."""
    proxy, local = fit_connections(
        [
            proxy_limits(
                max_connections=s.proxy_max_connections,
                max_header_bytes=s.max_header_bytes,
                header_timeout_s=s.header_timeout_s,
            ),
            ListenerLimits.of(
                "agent-metrics", s, section="agent", connections="listen_max_connections"
            ),
        ],
        reserve=_FD_RESERVE,
    )
    return proxy, local
