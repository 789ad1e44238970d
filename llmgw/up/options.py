"""What one `llmgw up` is asked to run (``UpOptions``) and where its listeners are reached.

What it must not do: read settings or the environment (commands/up.py turns flags and
settings into ``UpOptions``), or check anything against the machine (the launcher does).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["UpOptions"]


@dataclass(frozen=True, slots=True)
class UpOptions:
    data_dir: Path
    host: str
    port: int  # the public listener: the OpenAI API
    admin_port: int  # the control plane's internal listener: admin API, agent API, metrics
    demo: bool
    log_level: str
    config_path: Path | None
    # The internal listener's address. Never --host: the admin token can set engine argv on
    # every node, so publishing the OpenAI port must not publish the admin API with it.
    internal_host: str = "127.0.0.1"
    sim_gpus: int = 8
    demo_path: Path | None = None  # None: config/demo.yaml of this source tree
    # Where the agents' /healthz and /metrics listen (agent.listen_host); `up` picks their
    # ports, so it is `up` that says where to scrape them.
    agent_listen_host: str = "127.0.0.1"
    # The OpenAI API's processes: 0, the control plane's own public listener; N, a `llmgw
    # gateway` child with N workers, the control plane running without a public listener.
    gateway_workers: int = 0

    @property
    def admin_url(self) -> str:
        return _http_url(_connectable(self.internal_host), self.admin_port)

    def agent_metrics_url(self, port: int) -> str:
        return _http_url(_connectable(self.agent_listen_host), port) + "/metrics"

    @property
    def base_url(self) -> str:
        return _http_url(_connectable(self.host), self.port) + "/v1"


def _connectable(host: str) -> str:
    # A wildcard address is where one listens, not where one connects.
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
