"""Bringing `llmgw up` from "its processes are started" to "it is up", one tick at a time:
the control plane's readiness, the API key, the demo, the replicas' progress, the OpenAI
endpoint answering, then the announcement and up.json (0600).

Each step is retried on the next tick while what it needs is not there yet (a control plane
still importing, or restarting, answers nothing): only a control plane that never gets ready,
or exits while starting, ends the run.

What it must not do: start, restart or stop a process (launcher.py and supervision.py do),
or print a secret anywhere but the one announcement.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Literal

import httpx
from sqlalchemy.engine import URL, make_url

from llmgw.embedded_postgres import EmbeddedPostgres, libpq_url
from llmgw.errors import ConfigError, EngineStartError
from llmgw.logs import get_logger
from llmgw.up import bootstrap as api
from llmgw.up.children import Child
from llmgw.up.options import UpOptions

__all__ = ["UP_JSON", "BringUp"]

log = get_logger("llmgw.up")

UP_JSON = "up.json"
_CHILD_READY_TIMEOUT_S = 60.0
# While replicas come up, how often the endpoint is asked whether it answers already.
_PROBE_EVERY_S = 2.0

_Stage = Literal["controlplane", "key", "demo", "replicas", "gateway", "up"]


class BringUp:
    """The steps after the processes start; ``step()`` once per tick moves as far as it can."""

    def __init__(
        self,
        opts: UpOptions,
        admin_token: str,
        *,
        controlplane: Child,
        pg: EmbeddedPostgres,
        say: Callable[[str], None],
        show: Callable[[str], None],
        started_at: float,
        agent_metrics: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.opts = opts
        # (node name, /metrics URL) per agent, the simulated GPUs' agent first.
        self._agent_metrics = list(agent_metrics)
        self._token = admin_token
        self._cp = controlplane
        self._pg = pg
        self._say = say  # progress, to stderr
        self._show = show  # the announcement, to stdout
        self._t0 = started_at
        self._stage: _Stage = "controlplane"
        self._api_key = ""
        self._demo: api.Demo | None = None
        self._progress: api.Progress | None = None
        self._cp_deadline = time.monotonic() + _CHILD_READY_TIMEOUT_S
        self._say_waiting = True
        self._next_probe = time.monotonic() + _PROBE_EVERY_S

    @property
    def announced(self) -> bool:
        return self._stage == "up"

    def step(self) -> None:
        admin_url, token = self.opts.admin_url, self._token
        try:
            if self._stage == "controlplane":
                if self._readyz():
                    self._cp.ever_ready = True
                    self._stage = "key"
                elif time.monotonic() > self._cp_deadline:
                    raise EngineStartError(
                        f"the control plane was not ready within {_CHILD_READY_TIMEOUT_S:.0f}s "
                        f"at {admin_url}/readyz; its log:\n" + self._cp.log_tail()
                    )
            if self._stage == "key":
                self._api_key = api.ensure_api_key(self.opts.data_dir, admin_url, token)
                self._stage = "demo"
            if self._stage == "demo":
                self._demo = self._apply_demo()
                if self._demo is not None and self._demo.deployments:
                    self._say("Waiting for the demo's replicas:")
                    self._progress = api.Progress(self._demo.deployments, self._say)
                self._stage = "replicas"
            if self._stage == "replicas":
                progress = self._progress
                done = progress is None or progress.poll(admin_url, token)
                if not done and time.monotonic() >= self._next_probe:
                    # What the progress lines cannot see (a shard adopted by a restarted
                    # agent reports no change) the endpoint answering proves.
                    self._next_probe = time.monotonic() + _PROBE_EVERY_S
                    done = self._gateway_answers()
                    if done and progress is not None:
                        # The gateway learns of a ready shard (NOTIFY) as soon as this
                        # poll could: say what made it answer before moving on.
                        progress.poll(admin_url, token)
                if done:
                    self._stage = "gateway"
                    if self._say_waiting:
                        self._say("Waiting for the OpenAI endpoint to answer ...")
                        self._say_waiting = False
            if self._stage == "gateway" and self._gateway_answers():
                self._announce()
                self._stage = "up"
        except httpx.HTTPError as exc:
            # The control plane restarting, or not listening yet: the next tick retries.
            log.debug("up_step_retry", stage=self._stage, error=type(exc).__name__)

    def _readyz(self) -> bool:
        cp = self._cp
        if cp.popen is not None and cp.popen.poll() is not None and not cp.ever_ready:
            raise EngineStartError(
                f"the control plane exited with status {cp.popen.returncode} while starting; "
                f"its log ({cp.log_path}):\n{cp.log_tail()}"
            )
        r = httpx.get(f"{self.opts.admin_url}/readyz", timeout=2.0)
        return r.status_code == 200

    def _apply_demo(self) -> api.Demo | None:
        if not self.opts.demo:
            return None
        source = self.opts.demo_path or api.demo_file()
        if not source.is_file():
            raise ConfigError(
                f"the demo file {source} does not exist (llmgw installed without its config/ "
                "directory?); start with --no-demo and apply your own models",
                field="--no-demo",
            )
        first = not (self.opts.data_dir / api.DEMO_MARKER).exists()
        if first:
            self._say(f"Applying the demo ({source}) ...")
        return api.apply_demo(self.opts.data_dir, self.opts.admin_url, self._token, source)

    def _gateway_answers(self) -> bool:
        demo = self._demo
        model = demo.models[0] if demo is not None and demo.models else None
        return api.probe_gateway(self.opts.base_url, self._api_key, model)

    def _announce(self) -> None:
        opts, pg = self.opts, self._pg
        # The URL without its password: up.json is read by scripts and pasted into tickets; the
        # password stays in its own 0600 file, which the psql hint reads.
        app = make_url(pg.app_url)
        database_url = libpq_url(
            URL.create(
                app.drivername,
                username=app.username,
                host=app.host,
                port=app.port,
                database=app.database,
            ).render_as_string(hide_password=False)
        )
        took_s = time.monotonic() - self._t0
        models = self._demo.models if self._demo is not None else []
        info = {
            "base_url": opts.base_url,
            "api_key": self._api_key,
            "admin_url": opts.admin_url,
            "admin_token": self._token,
            "console_url": api.console_url(opts.admin_url),
            "database_url": database_url,
            "data_dir": str(opts.data_dir),
            "models": models,
            "pid": os.getpid(),
        }
        # The agents' own metrics (supervisor, sync, KV relay): `up` chose their ports, so
        # nothing else says where they are. The first agent's (the simulated GPUs', which run
        # the demo; the real GPUs' with --sim-gpus 0) is agent_metrics_url; a second agent,
        # for this machine's real GPUs, adds agent_gpu_metrics_url.
        for i, (_node, url) in enumerate(self._agent_metrics[:2]):
            info["agent_metrics_url" if i == 0 else "agent_gpu_metrics_url"] = url
        api.write_private(opts.data_dir / UP_JSON, json.dumps(info, indent=2) + "\n")
        log.info("up_ready", took_s=round(took_s, 2))
        self._show(
            api.announcement(
                base_url=opts.base_url,
                api_key=self._api_key,
                admin_url=opts.admin_url,
                admin_token=self._token,
                data_dir=opts.data_dir,
                psql=f"PGPASSWORD=$(cat {pg.app_password_path}) psql {database_url}",
                models=models,
                took_s=took_s,
                commands=api.Commands.of_this_process(),
                agent_metrics=self._agent_metrics,
            )
        )
