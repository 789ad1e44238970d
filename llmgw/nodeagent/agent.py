"""The node agent: inventory, registration, the sync loop, the supervisor and the KV relay,
wired together and run until SIGTERM.

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
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmgw import eventloop
from llmgw.config import AgentSettings
from llmgw.engines import EngineRegistry, EnginesConfig, SimConfig, base_env_from
from llmgw.engines.engine import host_port
from llmgw.errors import ConfigError
from llmgw.http.listeners import FD_RESERVE, ListenerLimits, fit_connections
from llmgw.logs import get_logger
from llmgw.nodeagent.client import ControlPlaneClient
from llmgw.nodeagent.inventory import (
    FileGpuSource,
    GpuSource,
    NvmlGpuSource,
    SimulatedGpuSource,
    collect_inventory,
    load_inventory_file,
)
from llmgw.nodeagent.metrics import AgentMetrics, EndpointServer
from llmgw.nodeagent.policy import LocalPolicy
from llmgw.nodeagent.prepare import NodeFacts
from llmgw.nodeagent.proxy import proxy_limits
from llmgw.nodeagent.records import ShardRecord
from llmgw.nodeagent.state import AgentState
from llmgw.nodeagent.supervisor import ShardHooks, Supervisor
from llmgw.nodeagent.supervisor_config import SupervisorConfig
from llmgw.nodeagent.sync import SyncLoop, SyncTiming
from llmgw.nodeagent.tokenizer_ship import TokenizerShipper
from llmgw.protocol import (
    MAX_SHARDS,
    ControlPlaneInstance,
    FabricInfo,
    NodeInventory,
    SyncResponse,
)
from llmgw.protocol.tokenizers import TokenizerUpload

__all__ = ["Agent", "AgentOptions", "agent_version", "default_mgmt_addr"]

log = get_logger("llmgw.nodeagent")

# How often the inventory is read again (XID/ECC counters, a GPU that fell off the bus).
_INVENTORY_REFRESH_S = 30.0
# Descriptors kept apart from the listeners' connections: per shard its ZMQ sockets, health
# checks, and the log and record files the supervisor reads; /proc reads on top.
_FD_RESERVE = FD_RESERVE + 8 * MAX_SHARDS


def agent_version() -> str:
    try:
        from importlib.metadata import version

        return version("llmgw")
    except Exception:
        return "0+unknown"


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


class _KvHooks:
    """Supervisor hooks feeding the KV relay (llmgw/nodeagent/kvrelay/relay.py)."""

    def __init__(self, relay: Any) -> None:
        self.relay = relay

    def _watch(self, rec: ShardRecord) -> None:
        if rec.kv_events_port > 0:
            self.relay.watch(
                rec.shard_id,
                sub_port=rec.kv_events_port,
                replay_port=rec.kv_replay_port or None,
                model=rec.model or str(rec.spec.get("profile", {}).get("served_model_name", "")),
                engine_generation=rec.generation,
            )

    def before_start(self, record: ShardRecord) -> None:
        self._watch(record)

    def adopted(self, record: ShardRecord) -> None:
        self._watch(record)

    def gone(self, shard_id: str) -> None:
        self.relay.unwatch(shard_id)


class Agent:
    def __init__(self, settings: AgentSettings, options: AgentOptions) -> None:
        self.settings = settings
        self.environ: Mapping[str, str] = (
            options.environ if options.environ is not None else dict(os.environ)
        )
        self.state = AgentState(options.state_dir)
        self._token = options.bootstrap_token
        self._stop_engines_on_exit = options.stop_engines_on_exit
        self.node_name = settings.node_name or socket.gethostname()
        self.mgmt_addr = settings.mgmt_addr or default_mgmt_addr(settings.controlplane_url)
        if settings.engine_bind_addr not in ("127.0.0.1", "::1", "localhost") and not (
            settings.trusted_management_network
        ):
            raise ConfigError(
                f"agent.engine_bind_addr {settings.engine_bind_addr!r} puts engines on a network: "
                "they are no security boundary (docs/architecture.md §6). Keep 127.0.0.1 and let the agent's "
                "proxy expose them, or set agent.trusted_management_network = true",
                field="agent.engine_bind_addr",
            )
        _check_port_ranges(settings)
        engines_cfg = EnginesConfig.model_validate(settings.engines)
        if engines_cfg.sim.python_executable == SimConfig().python_executable:
            # The simulator runs the same llmgw as the agent.
            engines_cfg = engines_cfg.model_copy(
                update={"sim": SimConfig(python_executable=sys.executable)}
            )
        self.engines_cfg = engines_cfg
        self.registry = EngineRegistry(engines_cfg)
        self.gpu_source = self._gpu_source()
        self._file_fabrics: list[FabricInfo] = []
        self._file_overrides: tuple[int | None, int | None] = (None, None)
        if settings.inventory_file:
            inv_file = load_inventory_file(settings.inventory_file)
            self._file_fabrics = inv_file.fabric_infos()
            self._file_overrides = (inv_file.cpu_threads, inv_file.memory_total_mb)
        self.policy = LocalPolicy(
            allowed_model_roots=tuple(settings.policy.allowed_model_roots),
            allowed_engines=tuple(settings.policy.allowed_engines),
            refused_flags=tuple(settings.policy.refused_flags),
            allowed_adapter_sources=tuple(settings.policy.allowed_adapter_sources),
        )
        self.inventory: NodeInventory = self._collect_inventory()
        self._inventory_at = time.monotonic()
        self.relay: Any = None
        self.tokenizers = TokenizerShipper(
            self._upload_tokenizer,
            engines=self.registry.get,
            allowed_roots=self.policy.allowed_model_roots,
        )
        self.supervisor = Supervisor(
            SupervisorConfig(
                shards_root=self.state.shards_root,
                wrapper_argv=(sys.executable, "-m", "llmgw", "shard-run"),
                port_range=(settings.port_range_start, settings.port_range_end),
                proxy_host=self.mgmt_addr,
                proxy_port_range=(settings.proxy_port_range_start, settings.proxy_port_range_end),
                proxy_metrics_token=self._metrics_token(),
                proxy_max_connections=settings.proxy_max_connections,
                max_header_bytes=settings.max_header_bytes,
                header_timeout_s=settings.header_timeout_s,
                stop_grace_s=settings.stop_grace_s,
                start_timeout_s=settings.start_timeout_s,
                restart_backoff_min_s=settings.restart_backoff_min_s,
                restart_backoff_max_s=settings.restart_backoff_max_s,
                crash_loop_after=settings.crash_loop_after,
                stable_after_s=settings.stable_after_s,
                log_max_bytes=settings.log_max_bytes,
                log_backups=settings.log_backups,
                adapter_root=self.state.root / "adapters",
                adapter_max_bytes=settings.policy.adapter_max_bytes,
                adapter_allow_loopback=settings.policy.adapter_fetch_allow_loopback,
            ),
            self.registry,
            self._facts,
            self.gpu_source,
            wrapper_env=base_env_from(self.environ),
        )
        self.client = ControlPlaneClient(
            settings.controlplane_url,
            ca_file=settings.controlplane_ca_file,
            allow_insecure_http=settings.allow_insecure_http,
            timeout_s=settings.sync_timeout_s,
        )
        self.sync: SyncLoop | None = None
        self.proxy: Any = None
        self.proxy_port = 0
        self._routes: dict[str, Any] = {}
        self.metrics: AgentMetrics | None = None
        self.endpoints: EndpointServer | None = None
        self._wake = asyncio.Event()

    # --- node facts ---------------------------------------------------------------

    def _gpu_source(self) -> GpuSource:
        s = self.settings
        if s.sim_gpus and s.inventory_file:
            raise ConfigError(
                "--sim-gpus and --inventory-file both describe the GPUs; pass one",
                field="agent.sim_gpus",
            )
        if s.sim_gpus:
            return SimulatedGpuSource(s.sim_gpus, node_name=self.node_name)
        if s.inventory_file:
            return FileGpuSource(load_inventory_file(s.inventory_file))
        try:
            return NvmlGpuSource()
        except ConfigError:
            log.warning(
                "nvml_unavailable",
                hint="no GPUs reported; use --sim-gpus N or --inventory-file on CPU machines",
            )
            return FileGpuSource(load_inventory_file_empty())

    def _collect_inventory(self) -> NodeInventory:
        fabrics = [
            FabricInfo(name=f.name, kind=f.kind, hcas=tuple(f.hcas), gid_index=f.gid_index)
            for f in self.settings.fabrics
        ]
        threads, mem = self._file_overrides
        return collect_inventory(
            self.gpu_source,
            fabrics=[*fabrics, *self._file_fabrics],
            engines=self.engines_cfg,
            llmgw_version=agent_version(),
            cpu_threads_override=self.settings.cpu_threads or threads,
            memory_override_mb=mem,
        )

    def current_inventory(self) -> NodeInventory:
        if time.monotonic() - self._inventory_at > _INVENTORY_REFRESH_S:
            self.inventory = self._collect_inventory()
            self._inventory_at = time.monotonic()
        return self.inventory

    def _facts(self) -> NodeFacts:
        return NodeFacts(
            gpus=self.inventory.gpus,
            fabrics=self.inventory.fabrics,
            mgmt_addr=self.mgmt_addr,
            bind_addr=self.settings.engine_bind_addr,
            policy=self.policy,
            environ=self.environ,
            base_env=base_env_from(self.environ),
        )

    def _bootstrap_token(self) -> str:
        if self._token:
            return self._token
        s = self.settings
        if s.bootstrap_token_file:
            try:
                return Path(s.bootstrap_token_file).read_text().strip()
            except OSError as e:
                log.error(
                    "bootstrap_token_unreadable", path=s.bootstrap_token_file, error=e.strerror
                )
                return ""
        return s.bootstrap_token

    # --- wiring ---------------------------------------------------------------------

    def _proxy_url(self, shard_id: str) -> str:
        """Where the gateway reaches a ready shard: its front door, the authenticating proxy its
        wrapper serves (docs/architecture.md §6), http://<mgmt_addr>:<port>/shards/<shard_id>;
        for a shard adopted from a wrapper too old to serve one, the agent's shared proxy."""
        rt = self.supervisor.runtimes.get(shard_id)
        if rt is not None and rt.proxy_port > 0:
            # Read from the wrapper's procs.json: the same URL from every agent that adopts it.
            return f"http://{host_port(rt.proxy_host, rt.proxy_port)}/shards/{shard_id}"
        if self.proxy is None or rt is None or not _served_by_agent(rt.record):
            return ""
        # Before the first desired set after a restart the proxy holds no keys (they come with
        # it), yet adopted engines are ready: reporting no URL then takes every engine of this
        # node out of the gateways' routes until the next sync (issue #12's fault suite saw a
        # sync period of 503s per agent restart). The routes follow within moments of that
        # sync's reply; until then the proxy's 404 not-found makes a gateway retry elsewhere.
        if shard_id not in self._routes and self.supervisor.desired is not None:
            return ""
        return f"http://{host_port(self.mgmt_addr, self.proxy_port)}/shards/{shard_id}"

    def _update_routes(self) -> None:
        """Expose, on the shared proxy, every ready leader adopted from a wrapper that serves
        no front door, once the control plane has given its key (after an agent restart, only
        once the first sync brought the keys back)."""
        routes: dict[str, Any] = {}
        if self.proxy is None:
            return
        from llmgw.nodeagent.proxy import ProxyRoute

        for sid, rt in self.supervisor.runtimes.items():
            desired = (self.supervisor.desired or {}).get(sid)
            if (
                _served_by_agent(rt.record)
                and rt.proxy_port == 0
                and rt.phase == "live"
                and rt.health == "ready"
                and rt.record.http_port > 0
                and int(rt.record.spec.get("rank", 0) or 0) == 0
                and desired is not None
                and desired.digest == rt.record.digest
                and desired.desired.engine_api_key
            ):
                routes[sid] = ProxyRoute(rt.record.http_port, desired.desired.engine_api_key)
        if set(routes) != set(self._routes) or routes != self._routes:
            self.proxy.set_routes(routes)
            self._routes = routes

    def _bindings(self) -> list[Any]:
        return self.supervisor.bindings(proxy_url=self._proxy_url)

    async def _apply(self, resp: SyncResponse) -> None:
        assert resp.shards is not None
        self.supervisor.set_desired(resp.shards, confirmed_drain=resp.confirmed_drain)
        self._wake.set()

    def _on_instances(self, instances: tuple[ControlPlaneInstance, ...]) -> None:
        if self.relay is not None:
            self.relay.set_instances([(i.id, i.internal_url) for i in instances])

    def _start_relay(self) -> None:
        try:
            from llmgw.nodeagent.kvrelay.relay import KvRelay
        except ImportError:
            log.warning("kv_relay_unavailable")
            return
        assert self.metrics is not None

        def auth() -> str:
            ident = self.sync.identity if self.sync is not None else None
            return f"Bearer {ident.node_credential}" if ident is not None else ""

        self.relay = KvRelay(
            state_dir=self.state.root,  # the relay keeps its mirrors in <root>/kv/
            auth_header=auth,
            verify_tls=self.settings.controlplane_ca_file or True,
            allow_insecure_http=self.settings.allow_insecure_http,
            registry=self.metrics.registry,
        )
        hooks: ShardHooks = _KvHooks(self.relay)
        self.supervisor.hooks = hooks

    def _listener_limits(self) -> tuple[ListenerLimits, ListenerLimits]:
        """The proxy's and the /healthz listener's bounds, their caps fitted to the descriptor
        limit (raised to the hard one): an agent that ran out of descriptors failed its
        supervisor passes too (`too many open files` reading /proc)."""
        s = self.settings
        proxy, local = fit_connections(
            [
                proxy_limits(
                    max_connections=s.proxy_max_connections,
                    max_header_bytes=s.max_header_bytes,
                    header_timeout_s=s.header_timeout_s,
                ),
                ListenerLimits(
                    listener="agent-metrics",
                    max_connections=s.listen_max_connections,
                    max_header_bytes=s.max_header_bytes,
                    header_timeout_s=s.header_timeout_s,
                    connections_setting="agent.listen_max_connections",
                    header_bytes_setting="agent.max_header_bytes",
                ),
            ],
            reserve=_FD_RESERVE,
        )
        return proxy, local

    async def _start_proxy(self, limits: ListenerLimits) -> None:
        """The shared proxy on agent.proxy_port, only when this start found shards that need
        it: leaders started by an agent that served every engine's proxy itself, whose
        wrappers serve none. Every shard this agent starts has its own front door, so once
        those have been restarted nothing is served from the agent process."""
        legacy = sorted(
            sid
            for sid, rt in self.supervisor.runtimes.items()
            if rt.phase in ("unadopted", "live") and _served_by_agent(rt.record)
        )
        if not legacy:
            return
        from llmgw.nodeagent.proxy import EngineProxy

        self.proxy = EngineProxy(
            self.mgmt_addr,
            self.settings.proxy_port,
            metrics_token=self.supervisor.cfg.proxy_metrics_token,
            limits=limits,
        )
        self.proxy_port = await self.proxy.start()
        log.warning(
            "shared_proxy_serving_adopted_shards",
            shards=legacy,
            port=self.proxy_port,
            hint="these shards were started by an older agent and have no front door of their "
            "own; they move to one at their next restart",
        )

    def _metrics_token(self) -> str:
        path = self.settings.metrics_token_file
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

    def health(self) -> dict[str, Any]:
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

    def _ship_tokenizers(self) -> None:
        """Each ready leader's model tokenizer files, to the control plane (once per shard)."""
        runtimes = self.supervisor.runtimes
        self.tokenizers.forget(runtimes)
        self.tokenizers.ready(
            (sid, rt.record.spec)
            for sid, rt in runtimes.items()
            if rt.phase == "live"
            and rt.health == "ready"
            and int(rt.record.spec.get("rank", 0) or 0) == 0
        )

    async def _upload_tokenizer(self, request: TokenizerUpload) -> None:
        ident = self.sync.identity if self.sync is not None else None
        if ident is None:
            raise RuntimeError("not registered yet")
        await self.client.upload_tokenizer(request, credential=ident.node_credential)

    async def _supervise(self, stop: asyncio.Event) -> None:
        interval = self.settings.health_interval_s
        while not stop.is_set():
            try:
                await self.supervisor.tick()
                self._update_routes()
                self._ship_tokenizers()
            except Exception:
                log.exception("supervisor_pass_failed")
            self._wake.clear()
            await eventloop.wait_event(self._wake, interval)

    async def run(self, stop: asyncio.Event) -> None:
        self.state.ensure()
        epoch = self.state.new_epoch()
        self.supervisor.recover()
        # Probe what was adopted before the first sync, so the first report
        # already says which engines are ready.
        await self.supervisor.tick()
        sync = SyncLoop(
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
            inventory=self.current_inventory,
            bindings=self._bindings,
            apply=self._apply,
            on_instances=self._on_instances,
        )
        self.sync = sync
        if sync.identity is None and not self._bootstrap_token():
            raise ConfigError(
                f"this node is not registered (no identity in {self.state.root}) and has no "
                "bootstrap token: pass --bootstrap-token-file or set LLMGW_AGENT__BOOTSTRAP_TOKEN",
                field="agent.bootstrap_token",
            )
        self.metrics = AgentMetrics(
            shard_counts=self.supervisor.count_by_state,
            counters=lambda: dict(self.supervisor.counters),
            sync_failures=lambda: sync.num_failures_total,
        )
        sync._observe_latency = self.metrics.sync_latency.observe
        self._start_relay()
        proxy_limits, local_limits = self._listener_limits()
        self.endpoints = EndpointServer(
            self.settings.listen_host,
            self.settings.listen_port,
            self.metrics.registry,
            self.health,
            limits=local_limits,
        )
        port = await self.endpoints.start()
        await self._start_proxy(proxy_limits)
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
            gpus=len(self.inventory.gpus),
            inventory=self.inventory.source,
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
            if self._stop_engines_on_exit:
                await self._stop_all_engines()
            await self.endpoints.stop()
            if self.proxy is not None:
                await self.proxy.stop()
            await self.tokenizers.close()
            await self.supervisor.close()
            await self.client.close()
            self.gpu_source.close()
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


def _served_by_agent(rec: ShardRecord) -> bool:
    """A leader serving HTTP whose record has no front door port: started by an agent that
    served every engine's proxy itself (an agent that allocates front doors gives every such
    leader one, or none when it has no key, and then no proxy may serve it either)."""
    return rec.proxy_port == 0 and rec.http_port > 0 and int(rec.spec.get("rank", 0) or 0) == 0


def _check_port_ranges(s: AgentSettings) -> None:
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


def load_inventory_file_empty() -> Any:
    from llmgw.nodeagent.inventory.file import InventoryFile

    return InventoryFile()
