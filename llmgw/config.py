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

__all__ = [
    "AgentSettings",
    "ControlPlaneSettings",
    "GatewaySettings",
    "LogSettings",
    "Settings",
    "UpSettings",
    "default_data_dir",
    "load_settings",
]

_DB_URL_RE = re.compile(r"^postgresql(\+psycopg)?://")
_URL_PASSWORD_RE = re.compile(r"(://[^:/@]*:)[^@]*@")


def _hide_password(text: str) -> str:
    return _URL_PASSWORD_RE.sub(r"\1***@", text)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    # None: JSON lines when stderr is not a terminal, console output when it is.
    json_lines: bool | None = Field(default=None, alias="json")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


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
