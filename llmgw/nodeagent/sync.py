"""The sync loop: register once, then pull the desired shard set and report bindings (docs/architecture.md §5).

Every ~2 s (jittered so a thousand agents restarted together do not sync in
step) the agent posts its bindings, its inventory when it changed, and the
desired_version it last applied; the answer is either "unchanged" or the
node's complete desired set, which it hands to the supervisor. A change the
control plane waits on (an engine's runtime adapter loaded: requests for it are
held in the gateways until then) pokes the loop to sync at once instead.

Failures back off exponentially and change nothing on the node (fail
static): engines keep running on the last desired set, crashed ones keep
being restarted by the supervisor. The log says what changed, once: one line
when the control plane becomes unreachable, one when it is back, never one
per attempt (a node that logs every failed sync buries the one line that
matters, and a fleet of them floods the log pipeline during an outage).

A control plane that answers with another cluster id than the one this node
registered with (a restored or foreign database) is not obeyed: the agent
keeps its engines, stops applying instructions and says so once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from llmgw.eventloop import cancel_and_wait, wait_event
from llmgw.logs import get_logger
from llmgw.nodeagent.client import ControlPlaneClient, ControlPlaneError, Incompatible, Refused
from llmgw.nodeagent.state import AgentState, NodeIdentity
from llmgw.periodic import backoff_delay
from llmgw.protocol import (
    PROTOCOL_VERSION,
    ControlPlaneInstance,
    NodeInventory,
    RegisterRequest,
    ShardBinding,
    SyncRequest,
    SyncResponse,
)

__all__ = ["SyncLoop", "SyncState", "SyncTiming", "backoff_s"]

log = get_logger("llmgw.nodeagent.sync")

SyncState = Literal[
    "starting", "synced", "pending", "unreachable", "refused", "incompatible", "cluster_mismatch"
]


@dataclass(frozen=True, slots=True)
class SyncTiming:
    interval_s: float = 2.0
    backoff_max_s: float = 30.0
    jitter: float = 0.2
    # A round asked for early (``SyncLoop.poke``) starts at least this long after the one
    # before: a burst of changes on a node is one report, not one each.
    early_gap_s: float = 0.25


def backoff_s(failures: int, timing: SyncTiming, rand: float) -> float:
    """Seconds to wait after `failures` consecutive failures (0: a normal interval).

    `rand` in [0, 1) spreads the waits by +-jitter so agents that failed
    together do not retry together.
    """
    base = (
        timing.interval_s
        if failures <= 0
        else backoff_delay(failures, timing.interval_s, timing.backoff_max_s)
    )
    return base * (1 - timing.jitter + 2 * timing.jitter * rand)


class SyncLoop:
    def __init__(
        self,
        client: ControlPlaneClient,
        state: AgentState,
        *,
        timing: SyncTiming,
        epoch: int,
        node_name: str,
        mgmt_addr: str,
        agent_version: str,
        bootstrap_token: Callable[[], str],
        inventory: Callable[[], NodeInventory],
        bindings: Callable[[], list[ShardBinding]],
        apply: Callable[[SyncResponse], Awaitable[None]],
        on_instances: Callable[[tuple[ControlPlaneInstance, ...]], None] = lambda _i: None,
        observe_latency: Callable[[float], None] = lambda _s: None,
    ) -> None:
        self.client = client
        self.state_dir = state
        self.timing = timing
        self.epoch = epoch
        self.node_name = node_name
        self.mgmt_addr = mgmt_addr
        self.agent_version = agent_version
        self._token = bootstrap_token
        self._inventory = inventory
        self._bindings = bindings
        self._apply = apply
        self._on_instances = on_instances
        self._observe_latency = observe_latency
        self.identity: NodeIdentity | None = state.load_identity()
        self.seq = 0
        self.desired_version: str | None = None
        self._sent_inventory: NodeInventory | None = None
        self.state: SyncState = "starting"
        self.failures = 0
        self.num_failures_total = 0
        self.last_ok_mono: float | None = None
        self.instances: tuple[ControlPlaneInstance, ...] = ()
        self._poked = asyncio.Event()
        self._round_started = float("-inf")

    def poke(self) -> None:
        """Sync soon rather than at the next period: something the control plane acts on
        changed on this node (an adapter loaded). A failing loop keeps its backoff."""
        self._poked.set()

    # --- state changes, logged once ---------------------------------------------

    def _enter(self, state: SyncState, event: str, **fields: Any) -> None:
        if state == self.state:
            return
        previous = self.state
        self.state = state
        level = "info" if state in ("synced", "pending") else "warning"
        if state == "cluster_mismatch":
            level = "error"
        getattr(log, level)(event, previous=previous, url=self.client.url, **fields)

    # --- one round ------------------------------------------------------------------

    async def _register(self) -> NodeIdentity:
        token = self._token()
        if not token:
            raise Refused(
                "this node has no credential and no bootstrap token: pass "
                "--bootstrap-token-file, or set LLMGW_AGENT__BOOTSTRAP_TOKEN"
            )
        inventory = self._inventory()
        resp = await self.client.register(
            RegisterRequest(
                protocol_version=PROTOCOL_VERSION,
                bootstrap_token=token,
                node_name=self.node_name,
                mgmt_addr=self.mgmt_addr,
                inventory=inventory,
                agent_version=self.agent_version,
            )
        )
        identity = NodeIdentity(
            node_id=resp.node_id,
            node_credential=resp.node_credential,
            cluster_id=resp.cluster_id,
            controlplane_url=self.client.url,
        )
        self.state_dir.save_identity(identity)
        self._sent_inventory = inventory
        log.info(
            "node_registered",
            node=resp.node_id,
            cluster=resp.cluster_id,
            approval_state=resp.approval_state,
        )
        return identity

    async def round(self, *, apply: bool = True) -> None:
        """One sync; raises ControlPlaneError on failure. ``apply=False`` only reports (the
        agent's last word before it exits): the answer's desired set is not acted on."""
        # Cleared before the bindings are read: a change after this point pokes again.
        self._poked.clear()
        self._round_started = time.monotonic()
        if self.identity is None:
            self.identity = await self._register()
        identity = self.identity
        inventory = self._inventory()
        send_inventory = inventory if inventory != self._sent_inventory else None
        self.seq += 1
        request = SyncRequest(
            protocol_version=PROTOCOL_VERSION,
            node_id=identity.node_id,
            agent_epoch=self.epoch,
            seq=self.seq,
            desired_version=self.desired_version,
            bindings=tuple(self._bindings()),
            inventory=send_inventory,
        )
        t0 = time.perf_counter()
        resp = await self.client.sync(request, credential=identity.node_credential)
        self._observe_latency(time.perf_counter() - t0)
        if send_inventory is not None:
            self._sent_inventory = send_inventory
        if resp.cluster_id != identity.cluster_id:
            self._enter(
                "cluster_mismatch",
                "cluster_id_mismatch",
                node=identity.node_id,
                registered_cluster=identity.cluster_id,
                answered_cluster=resp.cluster_id,
                action="engines kept running; instructions ignored until the cluster id matches",
            )
            return
        if resp.approval_state == "pending":
            self._enter("pending", "node_pending_approval", node=identity.node_id)
            return
        self._enter(
            "synced", "controlplane_synced", node=identity.node_id, instance=resp.instance_id
        )
        self.last_ok_mono = time.monotonic()
        if resp.instances != self.instances:
            self.instances = resp.instances
            self._on_instances(resp.instances)
        if apply and not resp.unchanged and resp.shards is not None:
            await self._apply(resp)
            self.desired_version = resp.desired_version

    async def run(self, stop: asyncio.Event) -> None:
        rng = random.Random()
        stopping = asyncio.create_task(self._poke_on(stop), name="sync-stop")
        try:
            await self._run(stop, rng)
        finally:
            await cancel_and_wait(stopping)

    async def _poke_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._poked.set()

    async def _pause(self, stop: asyncio.Event, wait_s: float) -> None:
        """The period (or backoff), cut short by a poke once ``early_gap_s`` has passed since
        the last round began."""
        deadline = time.monotonic() + wait_s
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not await wait_event(self._poked, left) or stop.is_set():
                return
            if self.failures:
                # Unreachable or refused: a change on the node does not shorten the backoff.
                await wait_event(stop, max(0.0, deadline - time.monotonic()))
                return
            gap = self._round_started + self.timing.early_gap_s - time.monotonic()
            if gap > 0:
                await wait_event(stop, min(gap, left))
            return

    async def _run(self, stop: asyncio.Event, rng: random.Random) -> None:
        while not stop.is_set():
            try:
                await self.round()
                self.failures = 0
            except ControlPlaneError as e:
                self.failures += 1
                self.num_failures_total += 1
                if isinstance(e, Refused):
                    self._enter("refused", "controlplane_refused", error=e.message, status=e.status)
                elif isinstance(e, Incompatible):
                    self._enter("incompatible", "controlplane_incompatible", error=e.message)
                else:
                    self._enter("unreachable", "controlplane_unreachable", error=e.message)
            except Exception:
                # A bug in applying an answer must not end syncing (and with it
                # every report); it is logged with its trace and retried.
                self.failures += 1
                self.num_failures_total += 1
                log.exception("sync_round_failed")
            wait = backoff_s(self.failures, self.timing, rng.random())
            await self._pause(stop, wait)
