"""The ``[agent]`` section: the node agent's control plane, inventory, policy, engines,
ports and timings.

What it must not do: read the environment or a file (loading.py does).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from llmgw.config.section import Section
from llmgw.protocol.names import name_problem

__all__ = ["AgentSettings"]


class AgentSettings(Section):
    controlplane_url: str = Field(
        default="http://127.0.0.1:8081",
        description="Internal URL of a control plane (TLS is required off loopback).",
    )
    state_dir: str = Field(
        default="", description="Where the agent keeps its state. Empty: <data dir>/agent."
    )
    node_name: str = Field(default="", description="Empty: the host name.")
    sync_interval_s: float = Field(default=2.0, gt=0, le=60)

    class Fabric(Section):
        """A fabric this node is on (docs/architecture.md §4 placement); the agent checks its HCAs exist."""

        name: str = Field(min_length=1, description='"ib0", "roce-a", or "nvl:<domain>".')
        kind: Literal["ib", "roce", "nvl"]
        hcas: list[str] = Field(default_factory=list)
        gid_index: int | None = Field(default=None, ge=0, description="RoCE v2 GID index.")

    class Policy(Section):
        """What this node agrees to run, whatever the control plane sends (docs/architecture.md §4)."""

        allowed_model_roots: list[str] = Field(
            default_factory=list,
            description="Directories model paths must sit under. Empty: any path.",
        )
        allowed_engines: list[str] = Field(
            default_factory=list, description="Engines this node runs. Empty: every one it offers."
        )
        refused_flags: list[str] = Field(
            default_factory=lambda: ["--trust-remote-code"],
            description="Engine flags a profile may not pass, however spelled.",
        )
        allowed_adapter_sources: list[str] = Field(
            default_factory=list,
            description="Local directories or http(s):// URL prefixes LoRA adapters may come "
            "from. Empty: local paths under allowed_model_roots, no downloads.",
        )
        adapter_max_bytes: int = Field(default=2 << 30, gt=0)
        # Only tests serve adapters from 127.0.0.1: a download that may reach
        # loopback, link-local or the cloud metadata address reads the node's secrets.
        adapter_fetch_allow_loopback: bool = False

    controlplane_ca_file: str = Field(
        default="", description="CA bundle for the control plane's certificate. Empty: system CAs."
    )
    metrics_token_file: str = Field(
        default="",
        description="File holding the bearer token Prometheus sends to scrape engines' /metrics "
        "through the proxy (GET /shards/<id>/metrics only). Empty: only each shard's own key.",
    )
    allow_insecure_http: bool = Field(
        default=False,
        description="Allow http:// to a control plane off loopback (credentials in clear text).",
    )
    bootstrap_token: str = Field(
        default="",
        description="One-time registration token; prefer LLMGW_AGENT__BOOTSTRAP_TOKEN or a file.",
        repr=False,
    )
    bootstrap_token_file: str = Field(default="", description="File holding the bootstrap token.")
    mgmt_addr: str = Field(
        default="",
        description="Address peers and the gateway reach this node on. Empty: the address of "
        "the interface that routes to the control plane.",
    )
    inventory_file: str = Field(
        default="", description="YAML/JSON inventory (GPUs, MIG, fabrics) instead of NVML."
    )
    sim_gpus: int = Field(
        default=0, ge=0, le=64, description="Simulated GPUs (class sim) instead of NVML."
    )
    fabrics: list[Fabric] = Field(default_factory=list)
    cpu_threads: int = Field(
        default=0, ge=0, description="Threads offered to CPU engines. Empty (0): all of them."
    )
    engines: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine adapters' settings (llmgw.engines.EnginesConfig keys: disabled, "
        "vllm.path, sim.python_executable, ...).",
    )
    policy: Policy = Field(default_factory=Policy)
    port_range_start: int = Field(
        default=20000, ge=1024, le=65535, description="Engines' and KV sockets' loopback ports."
    )
    port_range_end: int = Field(default=29999, ge=1024, le=65535)
    proxy_port_range_start: int = Field(
        default=19000,
        ge=1024,
        le=65535,
        description="Shards' front doors: each leader's authenticating proxy, served by its "
        "wrapper on mgmt_addr. The range gateways and Prometheus must reach (one firewall "
        "rule); it may not overlap port_range.",
    )
    proxy_port_range_end: int = Field(default=19999, ge=1024, le=65535)
    engine_bind_addr: str = Field(
        default="127.0.0.1",
        description="Where engines listen. Off loopback only with trusted_management_network.",
    )
    trusted_management_network: bool = False
    listen_host: str = Field(default="127.0.0.1", description="/healthz and /metrics address.")
    listen_port: int = Field(default=9400, ge=0, le=65535)
    proxy_port: int = Field(
        default=9401,
        ge=0,
        le=65535,
        description="The agent's shared proxy, opened only for shards adopted from an older "
        "agent's wrappers, which serve no front door of their own.",
    )
    proxy_max_connections: int = Field(
        default=4096,
        ge=16,
        le=1_000_000,
        description="Open connections of each front door (and of the shared proxy) at most "
        "(default 4,096; each may hold a second one to its engine), lowered at start to what "
        "the descriptor limit allows. At the cap a new connection evicts the oldest one "
        "idle or still sending its headers; when every connection is inside a request, it "
        "is closed as soon as accepted.",
    )
    listen_max_connections: int = Field(
        default=256,
        ge=16,
        le=100_000,
        description="Open connections of the /healthz and /metrics listener at most "
        "(default 256), with the proxy's eviction rule.",
    )
    max_header_bytes: int = Field(
        default=64 << 10,
        ge=4 << 10,
        le=16 << 20,
        description="Largest request line plus headers the proxy and the /healthz listener "
        "read (default 64 KiB); a larger head is answered 431 and its connection closed, "
        "before the key is checked.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Time a request's line and headers may take to arrive at the proxy or "
        "the /healthz listener, from the connection's open or from their first byte "
        "(default 10 s); a slower client is answered 408 and closed.",
    )
    health_interval_s: float = Field(default=2.0, gt=0, le=60)
    start_timeout_s: float = Field(
        default=900.0, gt=0, description="Longest an engine may take to answer health."
    )
    stop_grace_s: float = Field(default=30.0, ge=0, description="SIGTERM to SIGKILL.")
    restart_backoff_min_s: float = Field(default=1.0, gt=0)
    restart_backoff_max_s: float = Field(default=60.0, gt=0)
    crash_loop_after: int = Field(
        default=3, ge=1, description="Consecutive failed starts that make a crash loop."
    )
    stable_after_s: float = Field(
        default=60.0, gt=0, description="Uptime after which a crash no longer counts as a loop."
    )
    adapter_call_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="Longest one call of the agent to an engine's runtime LoRA routes may take "
        "(a load reads the adapter from disk); past it the call counts as failed and the "
        "agent reads the engine's list before its next call.",
    )
    adapter_retry_min_s: float = Field(
        default=5.0,
        gt=0,
        description="Pause before a failed runtime adapter load or unload is tried again, "
        "doubled after each further failure up to adapter_retry_max_s.",
    )
    adapter_retry_max_s: float = Field(default=300.0, gt=0)
    sync_backoff_max_s: float = Field(default=30.0, gt=0)
    sync_timeout_s: float = Field(default=10.0, gt=0)
    log_max_bytes: int = Field(default=16 << 20, gt=0)
    log_backups: int = Field(default=3, ge=0)

    @field_validator("node_name")
    @classmethod
    def _check_node_name(cls, v: str) -> str:
        # Checked at start: the control plane refuses a registration under any other name,
        # and an agent that only learnt so from its refusals would retry forever.
        if v:
            problem = name_problem(v)
            if problem is not None:
                raise ValueError(f"{problem}; empty means the host name")
        return v

    @field_validator("engines")
    @classmethod
    def _check_engines(cls, v: dict[str, Any]) -> dict[str, Any]:
        from llmgw.engines import EnginesConfig

        EnginesConfig.model_validate(v)
        return v

    @field_validator("port_range_end")
    @classmethod
    def _check_range(cls, v: int, info: Any) -> int:
        start = info.data.get("port_range_start", 0)
        if v - start < 16:
            raise ValueError(
                f"must be at least port_range_start + 16 ({start + 16}): each shard takes up "
                "to three ports"
            )
        return v

    @field_validator("proxy_port_range_end")
    @classmethod
    def _check_proxy_range(cls, v: int, info: Any) -> int:
        start = info.data.get("proxy_port_range_start", 0)
        if v < start:
            raise ValueError(
                f"must be at least proxy_port_range_start ({start}): each leader shard takes "
                "one port of the range"
            )
        return v
