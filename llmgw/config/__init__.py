"""llmgw's settings: one typed tree, loaded once in the CLI and passed down.

Sources, strongest first: explicit values from command-line flags, ``LLMGW_*``
environment variables (sections joined by ``__``, e.g.
``LLMGW_CONTROLPLANE__ADMIN_TOKEN``), the TOML file given with ``--config``
(``config/llmgw.toml`` documents every key), then the defaults.

Nothing here reads the environment at import time, and nothing outside
``load_settings`` reads it at all (but ``default_data_dir``, for XDG_DATA_HOME): a
process gets its settings from its caller. A bad value fails at start with the key, the
value and what is allowed (``ConfigError``), never later in the middle of serving.

    section.py       Section, the base of every section; [log]
    controlplane.py  [controlplane], with [controlplane.reconcile] and [controlplane.agent_api]
    gateway.py       [gateway]
    agent.py         [agent]
    up.py            [up], and where `llmgw up` keeps its data by default
    loading.py       Settings (the whole tree) and load_settings, with its error messages
"""

from __future__ import annotations

from llmgw.config.agent import AgentSettings
from llmgw.config.controlplane import AgentApiSettings, ControlPlaneSettings, ReconcileSettings
from llmgw.config.gateway import GatewaySettings
from llmgw.config.loading import Settings, load_settings
from llmgw.config.section import LogSettings
from llmgw.config.up import UpSettings, default_data_dir

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
