"""The supervisor's settings: one flat record the agent fills from its own (AgentSettings).

Its own module because every part of the supervisor reads it: the shell (supervisor.py),
starting and stopping (launch.py), exits and their backoff (exits.py) and the probes
(health.py). It must NOT hold behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SupervisorConfig"]


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    shards_root: Path
    # How to start a wrapper: [python, -m, llmgw, shard-run]; --shard-dir is appended.
    wrapper_argv: tuple[str, ...]
    port_range: tuple[int, int] = (20000, 29999)
    # The CPUs CPU shards' cores are picked from (cores.py); empty: those the agent may run on.
    cpu_ids: tuple[int, ...] = ()
    # Each leader's front door (frontdoor.py): where it listens (the management address),
    # the range its port comes from, and what it is handed with the launch.
    proxy_host: str = "127.0.0.1"
    proxy_port_range: tuple[int, int] = (19000, 19999)
    proxy_metrics_token: str = field(default="", repr=False)
    proxy_max_body_bytes: int = 32 << 20
    proxy_max_connections: int = 4096
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    stop_grace_s: float = 30.0
    start_timeout_s: float = 900.0
    restart_backoff_min_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    crash_loop_after: int = 3
    stable_after_s: float = 60.0
    leader_wait_s: float = 600.0
    log_max_bytes: int = 16 << 20
    log_backups: int = 3
    health_timeout_s: float = 2.0
    # One suspend or resume call: vLLM's sleep copies the weights to host memory and its wake
    # copies them back (seconds to tens of seconds for a large model).
    control_timeout_s: float = 120.0
    # How long a stopped shard's GPUs may take to show free of its processes.
    gpu_release_s: float = 30.0
    # Where adapters fetched from http(s) sources are stored (adapters.py).
    adapter_root: Path | None = None
    adapter_max_bytes: int = 2 << 30
    adapter_allow_loopback: bool = False
    # After a start that failed before its wrapper ran (a download, a secret
    # file, no free port), the next attempt waits this long.
    start_retry_s: float = 30.0
