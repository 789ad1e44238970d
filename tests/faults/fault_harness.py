"""The fault suite's world: a Postgres it may kill, two gateways, one agent, and steady load.

Built on the gateway e2e fleet (tests/gateway/gateway_fleet.py, itself on tests/e2e's), with
three additions the faults need:

- ``KillablePostgres``: an embedded Postgres in a temp dir (not the session's shared test
  server, which other tests use), so ``kill -9`` of the postmaster and a restart on the same
  port and data dir touch nothing else.
- ``FaultFleet.start_agent_at`` with a chosen control plane, and ``restart_agent``: the
  same agent started again on the same state dir, ports and credentials, as under systemd
  (each shard's front door stays where it was: its wrapper serves it).
- ``Load``: worker threads using the official ``openai`` client, half streaming, with a
  client-side load balancer over the gateways: each worker sticks to one gateway and, when a
  connection to it cannot be made (nothing was sent, so nothing ran), retries once on the next
  one. Any other error is a failure of that request; every call is recorded with its start and
  end times, the gateway it went to and the usage the client saw.

What it must not do: decide what is acceptable. The test states the rules and the bounds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai

from llmgw.embedded_postgres import EmbeddedPostgres, PostgresStartError, throwaway_parent
from llmgw.store.migrations import upgrade
from tests.e2e.fleet_harness import ControlPlaneProc
from tests.gateway.gateway_fleet import GatewayFleet, metric_value
from tests.nodeagent.agent_harness import AgentProcess
from tests.support.procs import agent_port_base, free_port
from tests.support.waiting import wait_for

_T = TypeVar("_T", "Load", "ShardStates")

__all__ = [
    "SYSTEM_PROMPT",
    "Call",
    "FaultFleet",
    "KillablePostgres",
    "Load",
    "ShardStates",
    "precise_decisions",
    "running",
    "wait_until",
]

# Long enough to span many KV blocks, so the router tokenizes it and scores precisely.
SYSTEM_PROMPT = " ".join(
    f"rule {i}: the assistant answers question {i} briefly." for i in range(60)
)


class KillablePostgres:
    """A Postgres of the suite's own, at the migrations' head, that survives ``kill -9`` as data."""

    def __init__(self) -> None:
        # Durable, as an operator runs it: a throwaway server (fsync and synchronous_commit
        # off) acknowledges commits it has not written, and a kill -9 then loses the last of
        # them, which would show as lost usage that no production Postgres loses. The dir is
        # where the `postgres` user of a root run can enter (pytest's tmp_path is 0700 root).
        self.dir = Path(tempfile.mkdtemp(prefix="llmgw-faults-", dir=throwaway_parent()))
        self.dir.chmod(stat.S_IRWXU | stat.S_IXGRP | stat.S_IXOTH)
        self.pg = EmbeddedPostgres(self.dir / "pg")
        self.url = ""

    def start(self) -> str:
        self.url = self.pg.start()
        upgrade(self.url)
        return self.url

    def kill9(self) -> int:
        pid = self.pg.pid
        assert pid is not None, "postgres is not running"
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: self.pg.exited() is not None, timeout_s=10, what="the postmaster to die")
        return pid

    def restart(self, *, timeout_s: float = 30) -> None:
        """Same port, same data dir. Backends of the killed postmaster hold its shared memory
        for a moment after it died, and Postgres refuses to start until they are gone."""

        def attempt() -> bool:
            try:
                self.pg.restart()
            except PostgresStartError:
                return False
            return True

        wait_for(attempt, timeout_s=timeout_s, what="postgres to restart", interval_s=0.2)

    def stop(self) -> None:
        try:
            self.pg.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class FaultFleet(GatewayFleet):
    agent_ports: dict[str, dict[str, str]] = field(default_factory=dict)

    def start_agent_at(
        self, node: str, *, gpus: int, controlplane: ControlPlaneProc
    ) -> AgentProcess:
        """An agent syncing with ``controlplane``."""
        token = self.token()
        base = agent_port_base()
        agent = AgentProcess(
            state_dir=self.tmp / f"{node}-state",
            controlplane_url=controlplane.url,
            listen_port=free_port(),
            log_path=self.tmp / f"{node}.log",
            port_range=(base, base + 63),
            token=token,
            node_name=node,
            sim_gpus=gpus,
            extra_env={"LLMGW_AGENT__SYNC_INTERVAL_S": "0.3"},
        ).start()
        self.agents[node] = agent
        self.until(
            lambda: self.sql(
                "SELECT 1 FROM nodes n JOIN node_status s ON s.node_id = n.id "
                "WHERE n.name = %s AND s.last_sync_at IS NOT NULL",
                node,
            ),
            timeout_s=60,
            what=f"agent {node} to register and sync",
        )
        return agent

    def restart_agent(self, node: str) -> None:
        """Start the agent again with the same state dir, ports and credentials."""
        agent = self.agents[node]
        agent.start()
        wait_for(lambda: agent.health(), timeout_s=60, what=f"agent {node} to answer /healthz")

    def leader(self) -> ControlPlaneProc | None:
        for cp in self.controlplanes:
            if cp.alive():
                with contextlib.suppress(httpx.HTTPError):
                    if cp.leads():
                        return cp
        return None

    def shard_pids(self, deployment: str) -> dict[str, int]:
        """Engine pid of every running, unreleased shard of the deployment, by shard id."""
        rows = self.sql(
            "SELECT s.id::text, s.pid FROM shards s JOIN replicas r ON r.id = s.replica_id "
            "JOIN deployments d ON d.id = r.deployment_id "
            "WHERE d.name = %s AND NOT s.released ORDER BY s.id",
            deployment,
        )
        return {sid: int(pid) for sid, pid in rows if pid is not None}

    def desired_state(self) -> dict[str, list[Any]]:
        """Everything operators wrote: models, profiles, deployments, keys (the last-use stamp
        aside: serving a request updates it, and that is not a change of what was recorded)."""
        return {
            table: [
                row[0]
                for row in self.sql(
                    f"SELECT to_jsonb(t) - 'last_used_at' FROM {table} t ORDER BY t.name"
                )
            ]
            for table in ("models", "profiles", "deployments", "api_keys")
        }

    def kv_view(self, cp: ControlPlaneProc, shard_id: str) -> dict[str, Any] | None:
        """What ``cp``'s prefix index holds for a shard (None: no view there yet)."""
        r = httpx.get(
            f"{cp.url}/admin/v1/debug/kv/{shard_id}",
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=5,
        )
        if r.status_code == 404:
            return None
        r.raise_for_status()
        view: dict[str, Any] = r.json()
        view.pop("blocks", None)
        return view

    def usage(self, key_name: str) -> tuple[int, int, int]:
        """(requests, prompt tokens, completion tokens) in usage_buckets for one key."""
        row = self.sql(
            "SELECT coalesce(sum(u.requests), 0), coalesce(sum(u.prompt_tokens), 0), "
            "coalesce(sum(u.completion_tokens), 0) FROM usage_buckets u "
            "JOIN api_keys k ON k.id = u.api_key_id WHERE k.name = %s",
            key_name,
        )[0]
        return int(row[0]), int(row[1]), int(row[2])


def precise_decisions(cp: ControlPlaneProc, model: str) -> float:
    return metric_value(cp, "llmgw_prefix_decisions_total", model=model, method="precise")


class ShardStates:
    """Samples every shard's observed state (10 Hz) and keeps the transitions, so a failure
    message can say when the gateways' view of the fleet changed."""

    def __init__(self, fleet: FaultFleet) -> None:
        self._fleet = fleet
        self.transitions: list[tuple[float, str, str]] = []
        self.usage: list[tuple[float, str, int]] = []  # (time, key name, requests recorded)
        self._last: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-states", daemon=True)

    def start(self) -> ShardStates:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                rows = self._fleet.sql(
                    "SELECT s.id::text, s.observed_state || coalesce(' ' || s.observed_reason, '')"
                    " || ' pid=' || coalesce(s.pid::text, '-') || ' url=' || "
                    "coalesce(s.proxy_url, '-') FROM shards s WHERE NOT s.released"
                )
            except Exception:  # Postgres down: nothing to sample
                continue
            for sid, state in rows:
                if self._last.get(sid) != state:
                    self._last[sid] = state
                    self.transitions.append((time.monotonic(), sid[:8], state))
            with contextlib.suppress(Exception):
                for name, n in self._fleet.sql(
                    "SELECT k.name, sum(u.requests) FROM usage_buckets u "
                    "JOIN api_keys k ON k.id = u.api_key_id GROUP BY k.name"
                ):
                    self.usage.append((time.monotonic(), name, int(n)))

    def around(self, t: float, *, before_s: float = 2, after_s: float = 10) -> str:
        return "\n".join(
            f"  {ts - t:+.2f}s {sid} {state}"
            for ts, sid, state in self.transitions
            if t - before_s <= ts <= t + after_s
        )


@dataclass
class Call:
    """One request as the client saw it."""

    worker: int
    key: str
    gateway: str  # where the request was finally sent
    stream: bool
    started: float  # monotonic
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    failed_over: bool = False  # the client-side balancer moved it to another gateway
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_tokens: int = 0
    wall: float = field(default_factory=time.time)  # wall-clock start, to match server logs


class Load:
    """Steady load: ``workers`` threads, each one request after another (paced by ``pause_s``).

    ``key`` is read before every request, so a phase switches the load to its own key and its
    usage can be compared with what the clients saw. ``calls`` holds every finished request.
    """

    def __init__(
        self,
        gateways: Callable[[], list[tuple[str, str]]],
        *,
        model: str,
        key: tuple[str, str],
        workers: int = 4,
        pause_s: float = 0.05,
    ) -> None:
        self._gateways = gateways
        self.model = model
        self.key = key  # (key name, key secret)
        self.workers = workers
        self.pause_s = pause_s
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: dict[tuple[str, str], openai.OpenAI] = {}
        self._homes = 0  # bumped by rebalance(): workers go back to their own gateway

    def rebalance(self) -> None:
        """Send each worker back to its home gateway (worker i to gateway i mod n), as a
        balancer does once a failed-over backend passes its health checks again."""
        self._homes += 1

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> Load:
        for i in range(self.workers):
            t = threading.Thread(target=self._run, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    # --- what happened --------------------------------------------------------------

    def snapshot(self, key_name: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if key_name is None or c.key == key_name]

    def successes_after(self, t: float, key_name: str) -> int:
        return sum(1 for c in self.snapshot(key_name) if c.ok and c.started > t)

    def probe(
        self, gateway: tuple[str, str], *, stream: bool = False, system: str = SYSTEM_PROMPT
    ) -> Call:
        """One request to one gateway (no balancer), recorded like the workers' requests."""
        name, url = gateway
        key_name, secret = self.key
        call = Call(-1, key_name, name, stream, time.monotonic(), max_tokens=4)
        try:
            self._one(self._client(url, secret), call, -1, len(self.calls), system)
            call.ok = True
        except Exception as exc:  # recorded, judged by the test
            call.error = _describe(exc)
        call.ended = time.monotonic()
        with self._lock:
            self.calls.append(call)
        return call

    # --- one worker -----------------------------------------------------------------

    def _client(self, url: str, secret: str) -> openai.OpenAI:
        c = self._clients.get((url, secret))
        if c is None:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0, timeout=30)
            self._clients[(url, secret)] = c
        return c

    def _run(self, worker: int) -> None:
        n = 0
        sticky = worker
        homes = self._homes
        while not self._stop.is_set():
            if homes != self._homes:
                homes, sticky = self._homes, worker
            gws = self._gateways()
            key_name, secret = self.key
            stream = n % 2 == 1
            max_tokens = 8 + (n * 7 + worker) % 17
            gw_index = sticky % len(gws)
            call = Call(
                worker=worker,
                key=key_name,
                gateway=gws[gw_index][0],
                stream=stream,
                started=time.monotonic(),
                max_tokens=max_tokens,
            )
            for attempt in range(2):
                name, url = gws[(gw_index + attempt) % len(gws)]
                call.gateway = name
                call.failed_over = attempt > 0
                try:
                    self._one(self._client(url, secret), call, worker, n)
                    call.ok = True
                    break
                except openai.APIConnectionError as exc:
                    call.error = _describe(exc)
                    if attempt == 0 and _never_connected(exc):
                        # The client-side balancer: nothing reached that gateway, so nothing
                        # ran; move this worker to the next gateway and send it there.
                        sticky += 1
                        continue
                    break
                except Exception as exc:  # a failure of this request, recorded as such
                    call.error = _describe(exc)
                    break
            call.ended = time.monotonic()
            with self._lock:
                self.calls.append(call)
            n += 1
            self._stop.wait(self.pause_s)

    def _one(
        self, client: openai.OpenAI, call: Call, worker: int, n: int, system: str = SYSTEM_PROMPT
    ) -> None:
        messages: Any = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"worker {worker} question {n}"},
        ]
        if not call.stream:
            r = client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=call.max_tokens
            )
            assert r.usage is not None
            call.prompt_tokens, call.completion_tokens = (
                r.usage.prompt_tokens,
                r.usage.completion_tokens,
            )
            return
        usage = None
        for chunk in client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=call.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None:
            raise RuntimeError("the stream ended without its usage chunk")
        call.prompt_tokens, call.completion_tokens = usage.prompt_tokens, usage.completion_tokens


def _never_connected(exc: openai.APIConnectionError) -> bool:
    """True when the TCP connection to the gateway could not be made: the request never left.

    By name: the `openai` client may carry its own copy of httpx (``httpx2.ConnectError``)."""
    cause: BaseException | None = exc
    while cause is not None:
        if any(t.__name__ == "ConnectError" for t in type(cause).__mro__):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    cause = exc.__cause__
    inner = f" <- {type(cause).__name__}" if cause is not None else ""
    text = str(exc).replace("\n", " ")[:160]
    return f"{type(exc).__name__}{inner}{f' {status}' if status else ''}: {text}"


@contextlib.contextmanager
def running(thing: _T) -> Iterator[_T]:
    """Start a ``Load`` or ``ShardStates`` for the block; stop it however the block ends."""
    thing.start()
    try:
        yield thing
    finally:
        thing.stop()


def wait_until(condition: Callable[[], Any], *, timeout_s: float, what: str) -> float:
    """Wait on ``condition``; return the monotonic time it first held."""
    wait_for(condition, timeout_s=timeout_s, what=what, interval_s=0.05)
    return time.monotonic()
