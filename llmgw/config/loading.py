"""The whole settings tree (``Settings``) and ``load_settings``, which reads it from the flags,
the environment and the TOML file, and says what is wrong without showing a secret.

What it must not do: read the environment anywhere but in ``load_settings``, or show a
token, a password or a URL's password in an error message.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from llmgw.config.agent import AgentSettings
from llmgw.config.controlplane import ControlPlaneSettings
from llmgw.config.gateway import GatewaySettings
from llmgw.config.section import LogSettings
from llmgw.config.up import UpSettings
from llmgw.errors import ConfigError

__all__ = ["Settings", "load_settings"]

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
