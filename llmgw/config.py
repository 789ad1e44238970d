"""llmgw's settings: one typed tree, loaded once in the CLI and passed down.

Sources, strongest first: explicit values from command-line flags, ``LLMGW_*``
environment variables (sections joined by ``__``, e.g.
``LLMGW_CONTROLPLANE__ADMIN_TOKEN``), the TOML file given with ``--config``
(``config/llmgw.toml`` documents every key), then the defaults below.

Nothing here reads the environment at import time, and nothing outside
``load_settings`` reads it at all: a process gets its settings from its caller.
A bad value fails at start with the key, the value and what is allowed
(``ConfigError``), never later in the middle of serving.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from llmgw.errors import ConfigError
from llmgw.protocol.kvstream import MAX_BODY_BYTES as KV_MAX_BODY_BYTES

__all__ = [
    "AgentApiSettings",
    "AgentSettings",
    "ControlPlaneSettings",
    "GatewaySettings",
    "LogSettings",
    "ReconcileSettings",
    "Settings",
    "UpSettings",
    "default_data_dir",
    "load_settings",
]

_DB_URL_RE = re.compile(r"^postgresql(\+psycopg)?://")
# A URL's password inside longer text (an error message quoting the value). Greedy up to the
# token's last "@": a password holding an unescaped "@" is hidden whole, never half-shown.
_URL_PASSWORD_RE = re.compile(r"(://[^:/@\s]*:)\S*@")


def _hide_password(text: str) -> str:
    """``text`` with any URL password replaced by ``***``; text without one is returned as is."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(text)
    except (ArgumentError, ValueError):
        url = None
    if url is not None and url.password is not None and "@" not in (url.host or ""):
        # A whole URL: SQLAlchemy's own rendering (it knows the URL's quoting rules).
        return url.render_as_string(hide_password=True)
    return _URL_PASSWORD_RE.sub(r"\1***@", text)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    # None: JSON lines when stderr is not a terminal, console output when it is.
    json_lines: bool | None = Field(default=None, alias="json")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ReconcileSettings(_Section):
    """The reconcile loop (leader only) and the rules its plan follows (design §4)."""

    enabled: bool = Field(
        default=True,
        description="Run the reconcile loop in this process (it only passes while it leads). "
        "Off: this control plane serves APIs only.",
    )
    tick_s: float = Field(
        default=2.0, gt=0, le=300, description="Seconds between passes when nothing wakes it."
    )
    sync_period_s: float = Field(
        default=2.0, gt=0, le=60, description="The agents' sync period (agent.sync_interval_s)."
    )
    node_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="A node whose agent has not synced for this long has its replicas replaced; "
        "at least 5 sync periods, so a node that misses a few syncs under load keeps them.",
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="How long a draining replica may keep serving."
    )
    crash_loop_restarts: int = Field(
        default=5, ge=1, description="Restarts after which a shard's replica is replaced."
    )
    leader_port_min: int = Field(default=29500, ge=1, le=65535)
    leader_port_max: int = Field(default=29999, ge=1, le=65535)


class AgentApiSettings(_Section):
    """The agent API on the internal listener: body caps, heartbeat batching, caches.

    Defaults are what a fleet of 1,000 nodes syncing every ~2 s needs.
    """

    # A sync carries up to 256 bindings with 8 KiB log tails each (2 MiB) plus an inventory.
    sync_max_body_bytes: int = Field(default=4 << 20, ge=64 << 10)
    # Registration is authenticated by a token inside the body: keep what an anonymous
    # client can make the process read small.
    register_max_body_bytes: int = Field(default=256 << 10, ge=16 << 10)
    kv_max_body_bytes: int = Field(default=KV_MAX_BODY_BYTES, ge=64 << 10)
    # Unchanged syncs only stamp last_sync_at: one UPDATE for all of them per period.
    heartbeat_flush_s: float = Field(default=1.0, gt=0, le=30)
    # controlplane_instances: beat period; an instance is live while seen within 3 periods.
    instance_heartbeat_s: float = Field(default=3.0, gt=0, le=60)
    # How often every node's row (credential, approval, drain, desired_version) is re-read in
    # one statement: unchanged syncs are answered from memory, so a reconciler's change
    # reaches an agent up to this much later. 0: read the node's row on every sync instead.
    node_refresh_s: float = Field(default=0.5, ge=0, le=30)
    # How often the placed-shard map the KV path reads is re-read (a sync that reads a node's
    # desired set updates that node's entries at once).
    placed_refresh_s: float = Field(default=5.0, gt=0, le=300)
    # Full KV copies admitted per second, and at once (429 + Retry-After beyond).
    kv_full_copy_rate_per_s: float = Field(default=200.0, gt=0)
    kv_full_copy_burst: int = Field(default=400, ge=1)


class ControlPlaneSettings(_Section):
    database_url: str = Field(
        default="",
        description="SQLAlchemy URL of the state store, postgresql+psycopg://user:pw@host:port/db. "
        "Empty under `llmgw up`, which starts its own Postgres.",
    )
    internal_host: str = Field(
        default="127.0.0.1",
        description="Address of the internal listener (admin API, agent API, metrics). "
        "Keep it off the public network.",
    )
    internal_port: int = Field(default=8081, ge=0, le=65535)
    admin_token: str = Field(
        default="",
        description="Bearer token for the admin API; at least 16 characters. "
        "Generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`.",
    )
    db_pool_size: int = Field(default=10, ge=1, le=200)
    db_connect_timeout_s: float = Field(default=5.0, gt=0)
    admin_max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest admin API request body read; a larger one is refused with 413 "
        "before it is buffered. Profiles are small: raise it only for huge args/env lists.",
    )
    shutdown_grace_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="On SIGTERM/SIGINT, how long open requests of both listeners may finish "
        "before they are cut.",
    )
    advertise_url: str = Field(
        default="",
        description="Where agents reach this process's internal listener (its agent API), "
        "e.g. https://cp-1.mgmt:8081. Empty: http://<internal_host>:<internal_port>, with "
        "this host's name for a wildcard address.",
    )
    reconcile: ReconcileSettings = ReconcileSettings()
    agent_api: AgentApiSettings = AgentApiSettings()

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if v and not _DB_URL_RE.match(v):
            raise ValueError(
                "must start with postgresql+psycopg:// (or postgresql://); "
                "llmgw stores its state in Postgres only"
            )
        if v.startswith("postgresql://"):
            # psycopg 3 is the one driver we ship; SQLAlchemy would otherwise look for psycopg2.
            v = "postgresql+psycopg://" + v.removeprefix("postgresql://")
        return v

    @field_validator("admin_token")
    @classmethod
    def _check_token(cls, v: str) -> str:
        if v and len(v) < 16:
            raise ValueError("must be at least 16 characters (a short token can be guessed)")
        return v


class GatewaySettings(_Section):
    host: str = Field(default="127.0.0.1", description="Address of the public OpenAI endpoint.")
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        le=256 * 1024 * 1024,
        description="Largest OpenAI request body read, after the key is checked; a larger "
        "one is refused with 413 before it is buffered.",
    )
    routing_policy: Literal[
        "auto", "precise", "approximate", "least_loaded", "round_robin", "random"
    ] = Field(
        default="auto",
        description="How a replica is chosen. auto: precise prefix scoring where the index "
        "is warm, else the approximate tree, else least-loaded; the others force one policy "
        "(for benchmarks and for isolating a routing problem).",
    )
    routes_refresh_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="Period of the route table's re-read, a safety net: every write that "
        "changes a route NOTIFYs the gateways (database triggers), which re-read at once.",
    )
    load_scrape_s: float = Field(
        default=0.5, gt=0, le=30, description="Period of the engines' /metrics scrape."
    )
    load_slack: int = Field(
        default=8,
        ge=0,
        description="Prefix routing considers only replicas whose load (running + waiting "
        "requests, this gateway's in-flight included) exceeds the least-loaded candidate's "
        "by at most this much; among them it weighs queued prefill against recomputing.",
    )
    recompute_weight: float = Field(
        default=3.0,
        ge=1.0,
        le=10.0,
        description="Precise routing: how much a prompt token recomputed on a replica that "
        "does not hold it counts against a token of prefill queued on one that does. 1: each "
        "request goes where its first token comes soonest by the gateway's estimate; above "
        "1 keeps prefixes on their holders longer (a copy elsewhere evicts other prompts): "
        "a higher hit rate for about the same tail (bench/routing.py). Approximate decisions "
        "always weigh 1 (the tree's claims may be long evicted). A prefix that more of the "
        "traffic shares than its holders can carry (a system prompt every chat opens with) "
        "is not weighed at all: sessions copy it to their homes.",
    )
    affinity_tokens: float = Field(
        default=768.0,
        ge=0.0,
        le=1_000_000,
        description="Prefix routing: how much more cost (queued prefill plus weighted "
        "recompute, in prompt tokens) a request accepts to land on its session's home "
        "replica: the session is `user` or x-session-id, else the prompt's first KV block "
        "past the prefix it shares with others (a chat's first question); the home is "
        "picked by rendezvous hashing. Homes spread chats that share a system prompt over "
        "the replicas instead of piling them onto its first holder, and two gateways agree "
        "on them without talking. Not applied to prompts nobody holds. 0: off.",
    )
    tokenize_timeout_s: float = Field(
        default=0.02,
        gt=0,
        le=5,
        description="Budget of the /tokenize call of precise routing; past it the request "
        "is routed by the approximate tree.",
    )
    tokenize_concurrency: int = Field(
        default=64, ge=1, description="Tokenize calls in flight at most; more skip precise."
    )
    precise_min_blocks: int = Field(
        default=4,
        ge=1,
        description="Prompts estimated (by characters) shorter than this many KV blocks "
        "skip tokenizing: a short prompt's hit saves less than the call costs.",
    )
    approx_max_entries: int = Field(
        default=200_000,
        ge=1000,
        description="Chunk entries of the approximate prefix tree, all models together "
        "(LRU beyond it).",
    )
    approx_ttl_s: float = Field(
        default=600.0, gt=0, description="Age past which the approximate tree forgets a chunk."
    )
    default_max_tokens: int = Field(
        default=4096,
        ge=1,
        description="Completion tokens reserved against a key's limits when a chat request "
        "sets no max_tokens and the model's context length (from its replicas' /v1/models) "
        "is not known yet; once known, the context length less the prompt is reserved.",
    )
    retry_budget_ratio: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Retries allowed per request served (a token bucket), so a failing fleet "
        "is not hit twice as hard.",
    )
    eject_after_failures: int = Field(
        default=3, ge=1, description="Consecutive upstream failures that eject a replica."
    )
    eject_for_s: float = Field(default=10.0, gt=0, description="How long an ejection lasts.")
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_read_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest silence of an upstream before a 502."
    )
    upstream_pool_size: int = Field(
        default=512, ge=1, description="Open connections to engines at most (all replicas)."
    )


class AgentSettings(_Section):
    controlplane_url: str = Field(
        default="http://127.0.0.1:8081",
        description="Internal URL of a control plane (TLS is required off loopback).",
    )
    state_dir: str = Field(
        default="", description="Where the agent keeps its state. Empty: <data dir>/agent."
    )
    node_name: str = Field(default="", description="Empty: the host name.")
    sync_interval_s: float = Field(default=2.0, gt=0, le=60)

    class Fabric(_Section):
        """A fabric this node is on (design §4 placement); the agent checks its HCAs exist."""

        name: str = Field(min_length=1, description='"ib0", "roce-a", or "nvl:<domain>".')
        kind: Literal["ib", "roce", "nvl"]
        hcas: list[str] = Field(default_factory=list)
        gid_index: int | None = Field(default=None, ge=0, description="RoCE v2 GID index.")

    class Policy(_Section):
        """What this node agrees to run, whatever the control plane sends (design §4)."""

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
    port_range_start: int = Field(default=20000, ge=1024, le=65535)
    port_range_end: int = Field(default=29999, ge=1024, le=65535)
    engine_bind_addr: str = Field(
        default="127.0.0.1",
        description="Where engines listen. Off loopback only with trusted_management_network.",
    )
    trusted_management_network: bool = False
    listen_host: str = Field(default="127.0.0.1", description="/healthz and /metrics address.")
    listen_port: int = Field(default=9400, ge=0, le=65535)
    proxy_port: int = Field(
        default=9401, ge=0, le=65535, description="The engines' authenticating proxy."
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
    sync_backoff_max_s: float = Field(default=30.0, gt=0)
    sync_timeout_s: float = Field(default=10.0, gt=0)
    log_max_bytes: int = Field(default=16 << 20, gt=0)
    log_backups: int = Field(default=3, ge=0)

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


class UpSettings(_Section):
    data_dir: str = Field(
        default="", description="Persistent data of `llmgw up`. Empty: $XDG_DATA_HOME/llmgw."
    )
    demo: bool = Field(default=True, description="Create the demo model on the simulator engine.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LLMGW_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    log: LogSettings = LogSettings()
    controlplane: ControlPlaneSettings = ControlPlaneSettings()
    gateway: GatewaySettings = GatewaySettings()
    agent: AgentSettings = AgentSettings()
    up: UpSettings = UpSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _CONFIG_FILE.get("path")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


# pydantic-settings builds sources from class-level hooks; this carries the one
# path chosen by `--config` into them for the duration of one load.
_CONFIG_FILE: dict[str, Path | None] = {}


def load_settings(config_path: str | Path | None = None, **overrides: Any) -> Settings:
    """Load settings from defaults, the TOML file, the environment and ``overrides``.

    ``overrides`` are section dicts (``controlplane={"internal_port": 0}``) from CLI flags.
    Raises ConfigError naming the key, the value and the rule.
    """
    path: Path | None = None
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass --config with the path of a "
                "TOML file (config/llmgw.toml is a documented example)",
                field="--config",
            )
    _CONFIG_FILE["path"] = path
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path), field=_first_field(exc)) from None
    except (ValueError, OSError) as exc:
        if path is None:  # pydantic-settings could not parse an LLMGW_* variable
            raise ConfigError(
                f"invalid configuration in the environment: {_hide_password(str(exc))}; a "
                "section such as LLMGW_LOG takes JSON, a key such as LLMGW_LOG__LEVEL a plain value"
            ) from None
        # A TOML syntax error, an unreadable file.
        raise ConfigError(
            f"cannot read config file {str(path)!r}: {exc}", field="--config"
        ) from None
    finally:
        _CONFIG_FILE.pop("path", None)


def _first_field(exc: ValidationError) -> str | None:
    errors = exc.errors()
    return ".".join(str(p) for p in errors[0]["loc"]) if errors else None


def _describe(exc: ValidationError, path: Path | None) -> str:
    lines = ["invalid configuration:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        env = "LLMGW_" + "__".join(str(p) for p in err["loc"]).upper()
        value = err.get("input")
        if "token" in key or "password" in key:
            shown = "<hidden>"
        elif isinstance(value, str):
            # A database URL carries its password: show the URL, never the secret in it.
            shown = repr(_hide_password(value))
        else:
            shown = repr(value)
        if err["type"] == "extra_forbidden":
            lines.append(
                f"  {key}: unknown setting (value {shown}); remove it or check its spelling"
            )
        else:
            lines.append(
                f"  {key} = {shown}: {err['msg']} (set via {env} or [{key.rsplit('.', 1)[0]}] in the config file)"
            )
    if path is not None:
        lines.append(f"  (config file: {path})")
    return "\n".join(lines)


def default_data_dir() -> Path:
    """Where `llmgw up` keeps its data when not told.

    $XDG_DATA_HOME/llmgw (~/.local/share/llmgw when unset or relative, as the XDG spec
    says); as root, /var/lib/llmgw instead: root's home is 0700, and the private
    Postgres runs as the `postgres` user, which could not enter a data dir under it.
    """
    xdg = os.environ.get("XDG_DATA_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "llmgw"
    if os.geteuid() == 0:
        return Path("/var/lib/llmgw")
    return Path.home() / ".local" / "share" / "llmgw"
