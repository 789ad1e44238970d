"""The agent's settings checked before anything runs, and the token files they name read.

Each refusal is a ConfigError naming the setting and the fix, raised while the agent starts:
a node that would serve engines on a network, hand two shards the same port, or publish its
metrics behind a guessable token must not come up at all. The bootstrap token alone is
forgiving (an unreadable file is logged and reads as none): a node registered before needs
none, and one that does is refused by ``require_bootstrap_token`` with the fix.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.config import AgentSettings
from llmgw.errors import ConfigError
from llmgw.logs import get_logger
from llmgw.protocol.names import name_problem

__all__ = [
    "check_engine_bind_addr",
    "check_port_ranges",
    "host_node_name",
    "read_bootstrap_token",
    "read_metrics_token",
    "require_bootstrap_token",
]

log = get_logger("llmgw.nodeagent")

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def check_engine_bind_addr(s: AgentSettings) -> None:
    """Engines listen on loopback unless the operator declared the management network trusted."""
    if s.engine_bind_addr not in _LOOPBACK and not s.trusted_management_network:
        raise ConfigError(
            f"agent.engine_bind_addr {s.engine_bind_addr!r} puts engines on a network: "
            "they are no security boundary (docs/architecture.md §6). Keep 127.0.0.1 and let the agent's "
            "proxy expose them, or set agent.trusted_management_network = true",
            field="agent.engine_bind_addr",
        )


def check_port_ranges(s: AgentSettings) -> None:
    """The engines' loopback range and the front doors' range must not meet: two allocators
    would hand out the same port, and a firewall rule for the front doors would open engines."""
    if (
        s.port_range_start <= s.proxy_port_range_end
        and s.proxy_port_range_start <= s.port_range_end
    ):
        raise ConfigError(
            f"agent.proxy_port_range {s.proxy_port_range_start}-{s.proxy_port_range_end} "
            f"overlaps agent.port_range {s.port_range_start}-{s.port_range_end}; move one "
            "(LLMGW_AGENT__PROXY_PORT_RANGE_START/END, LLMGW_AGENT__PORT_RANGE_START/END)",
            field="agent.proxy_port_range_start",
        )


def host_node_name(hostname: str) -> str:
    """The host name as the node's name, when agent.node_name is empty; a host name the
    name rule refuses (over 128 characters, say) is a start-up error naming the setting,
    not a registration the control plane refuses on every retry."""
    problem = name_problem(hostname)
    if problem is not None:
        raise ConfigError(
            f"agent.node_name is empty, and the host name cannot be the node's name: "
            f"{problem}; set agent.node_name (LLMGW_AGENT__NODE_NAME or --node-name)",
            field="agent.node_name",
        )
    return hostname


def read_metrics_token(s: AgentSettings) -> str:
    """The token Prometheus sends to the front doors' /metrics ("" when none is set)."""
    path = s.metrics_token_file
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"agent.metrics_token_file {path!r} cannot be read ({type(exc).__name__}); "
            "create it (one line, the token Prometheus sends) or leave the setting empty",
            field="agent.metrics_token_file",
        ) from None
    if len(token) < 16:
        raise ConfigError(
            f"agent.metrics_token_file {path!r} holds fewer than 16 characters; a short "
            "token can be guessed",
            field="agent.metrics_token_file",
        )
    return token


def read_bootstrap_token(s: AgentSettings, given: str = "") -> str:
    """The token to register with: the command line's, else the file's, else the setting's.
    Read at each registration attempt: a file put in place later is found."""
    if given:
        return given
    if s.bootstrap_token_file:
        try:
            return Path(s.bootstrap_token_file).read_text().strip()
        except OSError as e:
            log.error("bootstrap_token_unreadable", path=s.bootstrap_token_file, error=e.strerror)
            return ""
    return s.bootstrap_token


def require_bootstrap_token(token: str, state_root: Path) -> None:
    """A node not registered yet must hold a token to register with."""
    if not token:
        raise ConfigError(
            f"this node is not registered (no identity in {state_root}) and has no "
            "bootstrap token: pass --bootstrap-token-file or set LLMGW_AGENT__BOOTSTRAP_TOKEN",
            field="agent.bootstrap_token",
        )
