"""The KV relay wired to the agent: built from its settings, and told by the supervisor's hooks
which engines to watch (llmgw/nodeagent/kvrelay/relay.py).

The relay is optional at run time: an agent whose environment lacks its dependencies (ZMQ)
runs without one and says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from llmgw.logs import get_logger
from llmgw.nodeagent.records import ShardRecord

if TYPE_CHECKING:
    from llmgw.nodeagent.kvrelay.relay import KvRelay

__all__ = ["KvHooks", "make_relay"]

log = get_logger("llmgw.nodeagent")


class KvHooks:
    """Supervisor hooks (supervisor.ShardHooks) feeding the KV relay: an engine's KV events
    port is watched before the engine starts and when it is adopted, and let go with it."""

    def __init__(self, relay: KvRelay) -> None:
        self.relay = relay

    def _watch(self, rec: ShardRecord) -> None:
        if rec.kv_events_port > 0:
            self.relay.watch(
                rec.shard_id,
                sub_port=rec.kv_events_port,
                replay_port=rec.kv_replay_port or None,
                model=rec.model or rec.spec_view.served_model_name,
                engine_generation=rec.generation,
            )

    def before_start(self, record: ShardRecord) -> None:
        self._watch(record)

    def adopted(self, record: ShardRecord) -> None:
        self._watch(record)

    def gone(self, shard_id: str) -> None:
        self.relay.unwatch(shard_id)


def make_relay(
    *,
    state_root: Path,
    auth_header: Callable[[], str],
    verify_tls: bool | str,
    allow_insecure_http: bool,
    registry: CollectorRegistry,
) -> KvRelay | None:
    """The relay (not yet running: ``KvRelay.run``), or None where it cannot be imported."""
    try:
        from llmgw.nodeagent.kvrelay.relay import KvRelay
    except ImportError:
        log.warning("kv_relay_unavailable")
        return None
    return KvRelay(
        state_dir=state_root,  # the relay keeps its mirrors in <root>/kv/
        auth_header=auth_header,
        verify_tls=verify_tls,
        allow_insecure_http=allow_insecure_http,
        registry=registry,
    )
