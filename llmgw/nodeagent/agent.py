"""The node agent: inventory, registration, the sync loop, the supervisor and the KV relay,
wired together and run until SIGTERM.

This module composes; each part does its job elsewhere: the settings are checked
(agent_validation.py) and translated (agent_settings.py), the node read (agent_inventory.py),
shards supervised (supervisor.py), the KV relay wired to them (kv_wiring.py), leaders adopted
from older wrappers served (shared_proxy.py), tokenizer files shipped (tokenizer_ship.py).

Stopping the agent never stops an engine: engines run under their own
wrappers, and the systemd unit uses KillMode=process (config/llmgw-agent.service),
so `systemctl restart llmgw-agent` replaces the agent alone and the new one
adopts what runs.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from llmgw import eventloop
from llmgw.config import AgentSettings
from llmgw.engines import EngineRegistry, base_env_from
from llmgw.engines.engine import host_port
from llmgw.logs import get_logger
from llmgw.nodeagent import agent_settings, agent_validation
from llmgw.nodeagent.adapter_sync import AdapterSync
from llmgw.nodeagent.agent_inventory import NodeInventoryReader, agent_version
from llmgw.nodeagent.client import ControlPlaneClient
from llmgw.nodeagent.kv_wiring import KvHooks, make_relay
from llmgw.nodeagent.metrics import AgentMetrics, EndpointServer
from llmgw.nodeagent.prepare import NodeFacts
from llmgw.nodeagent.shared_proxy import SharedProxy
from llmgw.nodeagent.state import AgentState
from llmgw.nodeagent.supervisor import Supervisor
from llmgw.nodeagent.sync import SyncLoop, SyncTiming
from llmgw.nodeagent.tokenizer_ship import TokenizerShipper
from llmgw.protocol import ControlPlaneInstance, ShardBinding, SyncResponse
from llmgw.protocol.tokenizers import TokenizerUpload

if TYPE_CHECKING:
    # Imported where it is made (kv_wiring.make_relay): an agent without ZMQ runs without it.
    from llmgw.nodeagent.kvrelay.relay import KvRelay

__all__ = ["Agent", "AgentOptions", "agent_version", "default_mgmt_addr"]

log = get_logger("llmgw.nodeagent")


def default_mgmt_addr(controlplane_url: str) -> str:
    """The local address of the interface that routes to the control plane."""
    host = urlsplit(controlplane_url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """What the command line adds to the settings."""

    state_dir: Path
    bootstrap_token: str = ""
    environ: Mapping[str, str] | None = None
    # `llmgw up` only: its Ctrl-C must leave no engine behind (issue [up]); a fleet agent
    # keeps them running across its own restarts (docs/architecture.md §4).
    stop_engines_on_exit: bool = False


class Agent:
    def __init__(self, settings: AgentSettings, options: AgentOptions) -> None:
        self.settings = settings
        self.environ: Mapping[str, str] = (
            options.environ if options.environ is not None else dict(os.environ)
        )
        self.state = AgentState(options.state_dir)
        self._token = options.bootstrap_token
        self._stop_engines_on_exit = options.stop_engines_on_exit
        self.node_name = settings.node_name or agent_validation.host_node_name(socket.gethostname())
        self.mgmt_addr = settings.mgmt_addr or default_mgmt_addr(settings.controlplane_url)
        agent_validation.check_engine_bind_addr(settings)
        agent_validation.check_port_ranges(settings)
        engines_cfg = agent_settings.engines_config(settings)
        self.registry = EngineRegistry(engines_cfg)
        self.node = NodeInventoryReader(settings, node_name=self.node_name, engines=engines_cfg)
        self.policy = agent_settings.local_policy(settings)
        self.tokenizers = TokenizerShipper(
            self._upload_tokenizer,
            engines=self.registry.get,
            allowed_roots=self.policy.allowed_model_roots,
        )
        metrics_token = agent_validation.read_metrics_token(settings)
        self.supervisor = Supervisor(
            agent_settings.supervisor_config(
                settings,
                state_root=self.state.root,
                shards_root=self.state.shards_root,
                proxy_host=self.mgmt_addr,
                metrics_token=metrics_token,
            ),
            self.registry,
            self._facts,
            self.node.gpu_source,
            wrapper_env=base_env_from(self.environ),
        )
        self.adapters = AdapterSync(
            agent_settings.adapter_sync_config(settings, state_root=self.state.root),
            self.policy,
            on_change=self._report_soon,
        )
        self.shared_proxy = SharedProxy(
            self.mgmt_addr, settings.proxy_port, metrics_token=metrics_token
        )
        self.client = ControlPlaneClient(
            settings.controlplane_url,
            ca_file=settings.controlplane_ca_file,
            allow_insecure_http=settings.allow_insecure_http,
            timeout_s=settings.sync_timeout_s,
        )
        self.sync: SyncLoop | None = None
        self.relay: KvRelay | None = None
        self.metrics: AgentMetrics | None = None
        self.endpoints: EndpointServer | None = None
        self._wake = asyncio.Event()

    # --- what the parts are handed ----------------------------------------------------

    def _facts(self) -> NodeFacts:
        inventory = self.node.inventory
        return NodeFacts(
            gpus=inventory.gpus,
            fabrics=inventory.fabrics,
            mgmt_addr=self.mgmt_addr,
            bind_addr=self.settings.engine_bind_addr,
            policy=self.policy,
            environ=self.environ,
            base_env=base_env_from(self.environ),
        )

    def _bootstrap_token(self) -> str:
        return agent_validation.read_bootstrap_token(self.settings, self._token)

    def _credential(self) -> str | None:
        ident = self.sync.identity if self.sync is not None else None
        return ident.node_credential if ident is not None else None

    def _auth_header(self) -> str:
        credential = self._credential()
        return f"Bearer {credential}" if credential is not None else ""

    def _proxy_urls(self) -> dict[str, str]:
        """Where the gateway reaches each shard: its front door, the authenticating proxy its
        wrapper serves (docs/architecture.md §6), http://<mgmt_addr>:<port>/shards/<shard_id>;
        for a shard adopted from a wrapper too old to serve one, the agent's shared proxy."""
        desired_known = self.supervisor.desired is not None
        urls: dict[str, str] = {}
        for sid, rt in self.supervisor.runtimes.items():
            if rt.proxy_port > 0:
                # Read from the wrapper's procs.json: the same URL from every agent that adopts it.
                urls[sid] = f"http://{host_port(rt.proxy_host, rt.proxy_port)}/shards/{sid}"
            else:
                urls[sid] = self.shared_proxy.url(sid, rt, desired_known=desired_known)
        return urls

    def _bindings(self) -> list[ShardBinding]:
        return self.supervisor.bindings(
            proxy_urls=self._proxy_urls(), adapters=self.adapters.observed()
        )

    def _report_soon(self) -> None:
        if self.sync is not None:
            self.sync.poke()

    async def _apply(self, resp: SyncResponse) -> None:
        assert resp.shards is not None
        self.supervisor.set_desired(resp.shards, confirmed_drain=resp.confirmed_drain)
        self._wake.set()

    def _on_instances(self, instances: tuple[ControlPlaneInstance, ...]) -> None:
        if self.relay is not None:
            self.relay.set_instances([(i.id, i.internal_url) for i in instances])

    async def _upload_tokenizer(self, request: TokenizerUpload) -> None:
        credential = self._credential()
        if credential is None:
            raise RuntimeError("not registered yet")
        await self.client.upload_tokenizer(request, credential=credential)

    def health(self) -> dict[str, object]:
        sync = self.sync
        last = sync.last_ok_mono if sync is not None else None
        return {
            "status": "ok",
            "node": sync.identity.node_id if sync is not None and sync.identity else None,
            "sync_state": sync.state if sync is not None else "starting",
            "last_sync_age_s": round(time.monotonic() - last, 3) if last is not None else None,
            "shards": self.supervisor.count_by_state(),
        }

    # --- running ----------------------------------------------------------------------

    async def _supervise(self, stop: asyncio.Event) -> None:
        interval = self.settings.health_interval_s
        while not stop.is_set():
            try:
                await self.supervisor.tick()
                self.shared_proxy.update_routes(self.supervisor.runtimes, self.supervisor.desired)
                self.tokenizers.follow(self.supervisor.runtimes)
                # Runtime LoRA adapters converge in tasks of their own, one per engine: a load
                # never holds up this pass (adapter_sync.py).
                self.adapters.follow(self.supervisor.runtimes)
            except Exception:
                log.exception("supervisor_pass_failed")
            self._wake.clear()
            await eventloop.wait_event(self._wake, interval)

    async def run(self, stop: asyncio.Event) -> None:
        self.state.ensure()
        epoch = self.state.new_epoch()
        self.supervisor.recover()
        # Probe what was adopted before the first sync, so the first report
        # already says which engines are ready, and which runtime adapters they hold.
        await self.supervisor.tick()
        self.adapters.follow(self.supervisor.runtimes)
        metrics = self.metrics = AgentMetrics(
            shard_counts=self.supervisor.count_by_state,
            counters=lambda: dict(self.supervisor.counters),
            sync_failures=lambda: self.sync.num_failures_total if self.sync is not None else 0,
            adapter_counts=self.adapters.counts,
        )
        sync = self.sync = SyncLoop(
            self.client,
            self.state,
            timing=SyncTiming(
                interval_s=self.settings.sync_interval_s,
                backoff_max_s=self.settings.sync_backoff_max_s,
            ),
            epoch=epoch,
            node_name=self.node_name,
            mgmt_addr=self.mgmt_addr,
            agent_version=agent_version(),
            bootstrap_token=self._bootstrap_token,
            inventory=self.node.current,
            bindings=self._bindings,
            apply=self._apply,
            on_instances=self._on_instances,
            observe_latency=metrics.sync_latency.observe,
        )
        if sync.identity is None:
            agent_validation.require_bootstrap_token(self._bootstrap_token(), self.state.root)
        self.relay = make_relay(
            state_root=self.state.root,
            auth_header=self._auth_header,
            verify_tls=self.settings.controlplane_ca_file or True,
            allow_insecure_http=self.settings.allow_insecure_http,
            registry=metrics.registry,
        )
        if self.relay is not None:
            self.supervisor.hooks = KvHooks(self.relay)
        proxy_limits, local_limits = agent_settings.listener_limits(self.settings)
        self.endpoints = EndpointServer(
            self.settings.listen_host,
            self.settings.listen_port,
            metrics.registry,
            self.health,
            limits=local_limits,
        )
        port = await self.endpoints.start()
        await self.shared_proxy.start(self.supervisor.runtimes, proxy_limits)
        log.info(
            "agent_started",
            event_loop=type(asyncio.get_running_loop()).__module__.partition(".")[0],
            fd_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            proxy_max_connections=proxy_limits.max_connections,
            node_name=self.node_name,
            epoch=epoch,
            state_dir=str(self.state.root),
            controlplane=self.client.url,
            listen=f"{self.settings.listen_host}:{port}",
            gpus=len(self.node.inventory.gpus),
            inventory=self.node.inventory.source,
            shards_found=len(self.supervisor.runtimes),
        )
        eventloop.freeze_heap()  # started: what is alive now lives as long as the agent
        tasks = [
            asyncio.create_task(sync.run(stop), name="sync"),
            asyncio.create_task(self._supervise(stop), name="supervise"),
        ]
        if self.relay is not None:
            tasks.append(asyncio.create_task(self.relay.run(), name="kv-relay"))
        try:
            await stop.wait()
        finally:
            if self.relay is not None:
                await self.relay.close()
            await eventloop.cancel_and_wait(tasks)
            # Before any engine is stopped: no adapter call races an engine on its way out.
            await self.adapters.close()
            if self._stop_engines_on_exit:
                await self._stop_all_engines()
            await self.endpoints.stop()
            await self.shared_proxy.stop()
            await self.tokenizers.close()
            await self.supervisor.close()
            await self.client.close()
            self.node.close()
            log.info("agent_stopped", engines_left_running=len(self.supervisor.runtimes))

    async def _stop_all_engines(self) -> None:
        """Stop every shard (wrapper, engine, marked leftovers) before exiting: `llmgw up`'s
        Ctrl-C stops engines first, then the agent (issue [up])."""
        # Records are kept: the next start brings the same shards back at once, and the
        # report below says each one exited.
        await self.supervisor.stop_all(
            exit_reason="stopped: its agent exited (--stop-engines-on-exit)"
        )
        log.info("engines_stopped_on_exit")
        # Without a last report the control plane would show them ready, and gateways would
        # route to engines that are gone until the node's grace ran out.
        if self.sync is not None:
            try:
                await asyncio.wait_for(self.sync.round(apply=False), timeout=5)
            except Exception as exc:  # best effort: the node's grace covers a lost report
                log.warning("final_report_failed", error=type(exc).__name__)
