"""What `llmgw up` does through the APIs once its processes run: the agent's bootstrap token,
the API key it hands out, the demo, progress while replicas come up, the check that the
OpenAI endpoint answers, and the text it prints.

Everything here is idempotent across runs: the token, the key and the demo are created once
and reused (files in the data dir, 0600), so a second `llmgw up` resumes instead of piling up
keys and tokens.

What it must not do: start or stop processes (llmgw/up/launcher.py does), or print a secret
anywhere but the one announcement the user asked for.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from llmgw.documents import read_documents
from llmgw.errors import ConfigError, SpecError
from llmgw.logs import get_logger

__all__ = [
    "API_KEY_FILE",
    "DEMO_MARKER",
    "Commands",
    "Demo",
    "Progress",
    "announcement",
    "apply_demo",
    "console_url",
    "demo_file",
    "ensure_api_key",
    "ensure_bootstrap_token",
    "probe_gateway",
    "write_private",
]

log = get_logger("llmgw.up")

API_KEY_FILE = "api_key.json"
# Applied once: a second run must not undo `llmgw deployments scale demo 4` by re-applying.
DEMO_MARKER = "demo.applied"
_KEY_NAME = "llmgw-up"
# The agent registers within seconds; a day covers a first run interrupted and resumed later.
_TOKEN_TTL_S = 86_400


def write_private(path: Path, content: str) -> None:
    """Write a file only its owner can read, atomically (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(content)
    os.replace(tmp, path)


def demo_file() -> Path:
    """config/demo.yaml: the wheel's copy (``llmgw._config``) or the source tree's."""
    here = Path(__file__).resolve().parents[1]  # the llmgw package
    for candidate in (here / "_config" / "demo.yaml", here.parent / "config" / "demo.yaml"):
        if candidate.is_file():
            return candidate
    return here.parent / "config" / "demo.yaml"


# --- the agent's bootstrap token ------------------------------------------------------


def ensure_bootstrap_token(
    data_dir: Path, database_url: str, *, registered: bool, name: str = "agent"
) -> Path:
    """The file holding a usable single-use token for this machine's agent.

    An agent that registered before needs none (its identity is in its state dir); then the
    file is returned as it is. Otherwise the stored token is reused while the database says
    it still has a use left, and replaced when it is spent, revoked, expired or unknown (a
    data dir whose Postgres was recreated).
    """
    path = data_dir / f"{name}.bootstrap-token"
    meta = data_dir / f"{name}.bootstrap-token.id"
    if registered and path.is_file():
        return path
    token_id = meta.read_text().strip() if meta.is_file() and path.is_file() else ""
    token = asyncio.run(_token(database_url, token_id))
    if token is not None:
        write_private(path, token[1] + "\n")
        write_private(meta, token[0] + "\n")
        log.info("bootstrap_token_created", token_id=token[0])
    return path


async def _token(database_url: str, token_id: str) -> tuple[str, str] | None:
    """None: the stored token is still good; else a new (id, plaintext)."""
    from llmgw.store.bootstrap_tokens import create_bootstrap_token, has_use_left
    from llmgw.store.database import create_engine, session_factory

    engine = create_engine(database_url, pool_size=1)
    try:
        async with session_factory(engine)() as session, session.begin():
            if token_id and await has_use_left(session, token_id):
                return None
            new, plaintext = await create_bootstrap_token(
                session,
                ttl_s=_TOKEN_TTL_S,
                uses=1,
                description="llmgw up: an agent of this machine",
            )
            return new.id, plaintext
    finally:
        await engine.dispose()


# --- the API key ------------------------------------------------------------------------


def _admin(admin_url: str, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=admin_url + "/admin/v1",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10.0,
    )


def ensure_api_key(data_dir: Path, admin_url: str, admin_token: str) -> str:
    """The API key `up` hands out: the stored one while the control plane still knows it,
    else a new one (stored 0600). Raises httpx.HTTPError while the admin API is unreachable
    (the caller retries)."""
    path = data_dir / API_KEY_FILE
    stored: dict[str, Any] = {}
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except ValueError:
            stored = {}
    with _admin(admin_url, admin_token) as admin:
        if stored.get("name") and stored.get("key"):
            r = admin.get(f"/keys/{stored['name']}")
            if r.status_code >= 500:
                r.raise_for_status()
            current = r.json() if r.status_code == 200 else {}
            if current.get("id") == stored.get("id") and not current.get("disabled"):
                return str(stored["key"])
            log.warning("api_key_replaced", key_id=stored.get("id"), status=r.status_code)
        name = _KEY_NAME
        r = admin.post("/keys", json={"name": name})
        if r.status_code == 409:  # the name is taken by a key whose secret we no longer hold
            name = f"{_KEY_NAME}-{os.urandom(3).hex()}"
            r = admin.post("/keys", json={"name": name})
        if r.status_code >= 500:
            r.raise_for_status()
        if r.status_code >= 400:
            raise ConfigError(
                f"the admin API refused to create an API key ({r.status_code}): {_error_message(r)}"
            )
        reply = r.json()
    key = reply.get("key")
    if not isinstance(key, str) or not key:
        raise ConfigError("the admin API created an API key but its reply holds no `key`")
    write_private(path, json.dumps({"name": name, "id": reply.get("id"), "key": key}) + "\n")
    log.info("api_key_created", key_id=reply.get("id"))
    return key


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", {}).get("message") or r.text[:300])
    except ValueError:
        return r.text[:300]


# --- the demo -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Demo:
    deployments: list[str]
    # Names clients send: each model, then its profiles' LoRA adapters.
    models: list[str]


def apply_demo(data_dir: Path, admin_url: str, admin_token: str, source: Path) -> Demo:
    """Apply the demo file once (POST /apply, as `llmgw apply -f`).

    On later runs nothing is applied (whatever the operator changed since stays); the
    file is read again so progress can be shown for its deployments.
    """
    docs, _ = read_documents(str(source))
    demo = Demo(
        deployments=[str(d["name"]) for d in docs if d.get("kind") == "deployment"],
        models=[str(d["name"]) for d in docs if d.get("kind") == "model"]
        + [
            str(a["name"])
            for d in docs
            if d.get("kind") == "profile"
            for a in d.get("adapters") or []
        ],
    )
    marker = data_dir / DEMO_MARKER
    if marker.exists():
        return demo
    with _admin(admin_url, admin_token) as admin:
        r = admin.post("/apply", json={"documents": docs, "dry_run": False})
    if r.status_code == 422:
        problems = r.json().get("error", {}).get("problems") or []
        lines = [f"  {p.get('kind')}/{p.get('name')}: {p.get('message')}" for p in problems]
        raise SpecError(
            f"the demo in {source} was refused:\n"
            + "\n".join(lines or [_error_message(r)])
            + "\nfix the file, or start with --no-demo",
            field="--no-demo",
        )
    if r.status_code >= 500:
        r.raise_for_status()  # transient: the caller retries
    if r.status_code >= 400:
        raise SpecError(f"applying {source} failed ({r.status_code}): {_error_message(r)}")
    for result in r.json().get("results", []):
        log.info("demo_applied", kind=result.get("kind"), name=result.get("name"),
                 result=result.get("result"))  # fmt: skip
    write_private(marker, f"{source}\n")
    return demo


# --- progress -------------------------------------------------------------------------------


def _after(ts: Any, since: datetime) -> bool:
    if not isinstance(ts, str):
        return False
    try:
        at = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return False
    return (at if at.tzinfo else at.replace(tzinfo=UTC)) >= since


@dataclass
class Progress:
    """Says what changed while the deployments come up: a line per shard state or reason
    change, and one per deployment reason change (why replicas are not placed).

    Only what was observed since ``since`` (this run's start) counts: on a second run the
    database still says "ready" for engines the previous run stopped, and repeating that
    would be a lie until the agents report again.
    """

    deployments: list[str]
    say: Callable[[str], None]
    since: datetime = field(default_factory=lambda: datetime.now(UTC))
    _shards: dict[str, tuple[str, str]] = field(default_factory=dict)
    _reasons: dict[str, str] = field(default_factory=dict)

    def poll(self, admin_url: str, admin_token: str) -> bool:
        """True once every deployment has all its replicas ready (httpx errors propagate)."""
        done = True
        with _admin(admin_url, admin_token) as admin:
            for name in self.deployments:
                r = admin.get(f"/deployments/{name}")
                if r.status_code == 404:
                    done = False
                    continue
                r.raise_for_status()
                dep = r.json()
                status = dep.get("status") or {}
                reason = str(status.get("reason") or "")
                fresh = _after(status.get("updated_at"), self.since)
                if fresh and reason and self._reasons.get(name) != reason:
                    self.say(f"  {name}: {reason}")
                    self._reasons[name] = reason
                replicas = admin.get("/replicas", params={"deployment": name, "limit": 500})
                replicas.raise_for_status()
                ready = 0
                for rep in replicas.json().get("items", []):
                    shards = [s for s in rep.get("shards") or [] if not s.get("released")]
                    states = [self._shard(name, rep, shard) for shard in shards]
                    ready += (
                        rep.get("state") == "active"
                        and bool(states)
                        and all(st == "ready" for st in states)
                    )
                if ready < int(dep.get("replicas", 0)) or dep.get("state") != "active":
                    done = False
        return done

    def _shard(self, deployment: str, rep: dict[str, Any], shard: dict[str, Any]) -> str:
        """The shard's state as observed in this run (``pending`` before its first report)."""
        key = str(shard.get("id"))
        fresh = _after(shard.get("observed_at"), self.since)
        state = str(shard.get("observed_state") or "pending") if fresh else "pending"
        reason = str(shard.get("reason") or "") if fresh else ""
        if self._shards.get(key) == (state, reason):
            return state
        self._shards[key] = (state, reason)
        gpus = ",".join(str(g.get("index")) for g in shard.get("gpus") or [])
        where = f"on {shard.get('node')}" + (f" GPU {gpus}" if gpus else "")
        what = {"starting": "loading", "ready": "ready"}.get(state, state)
        line = f"  {deployment}: replica {str(rep.get('id'))[:8]} shard {shard.get('rank', 0)} {where}: {what}"
        if reason and state != "ready":
            line += f" ({reason})"
        self.say(line)
        return state


# --- the OpenAI endpoint ----------------------------------------------------------------------


def probe_gateway(base_url: str, api_key: str, model: str | None) -> bool:
    """Whether the OpenAI endpoint answers with this key: a chat completion on ``model`` (the
    demo), or the model list without one. False while not yet (routes not loaded)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        if model is None:
            r = httpx.get(f"{base_url}/models", headers=headers, timeout=5.0)
        else:
            r = httpx.post(
                f"{base_url}/chat/completions",
                headers=headers,
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "ping"}],
                    "max_tokens": 2,
                },
                timeout=10.0,
            )
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        log.debug("gateway_not_ready", status=r.status_code, body=r.text[:200])
    return r.status_code == 200


# --- what is printed ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Commands:
    """How the printed examples call llmgw's own Python and CLI: by the paths of the
    environment `up` runs in, since a newcomer's PATH has neither (the install puts `llmgw`
    in .venv/bin only, and the system's python3 has no openai client)."""

    python: str  # the interpreter running `up` (the virtual environment's)
    llmgw: str  # the `llmgw` script beside it, else `<python> -m llmgw`
    has_openai: bool  # whether that interpreter can import the openai client

    @classmethod
    def of_this_process(cls) -> Commands:
        python = sys.executable
        script = Path(python).with_name("llmgw")
        llmgw = shlex.quote(str(script)) if script.is_file() else f"{shlex.quote(python)} -m llmgw"
        return cls(python, llmgw, importlib.util.find_spec("openai") is not None)


def console_url(admin_url: str) -> str:
    """Where the web console answers: the internal listener's ``/ui``."""
    return f"{admin_url}/ui/"


def announcement(
    *,
    base_url: str,
    api_key: str,
    admin_url: str,
    admin_token: str,
    data_dir: Path,
    psql: str,
    models: list[str],
    took_s: float,
    commands: Commands,
    agent_metrics: Sequence[tuple[str, str]] = (),
) -> str:
    """The block printed once everything works; its examples are a shell snippet that runs
    as printed, in any shell, whatever its PATH (tests/up runs it)."""
    data_flag = f" --data-dir {shlex.quote(str(data_dir))}"
    none_yet = f"(none yet: {commands.llmgw} apply -f FILE)"
    metrics = "".join(f"  Agent metrics:    {url}   (node {node})\n" for node, url in agent_metrics)
    return (
        f"\nllmgw is up ({took_s:.1f}s).\n"
        f"  OpenAI base URL:  {base_url}\n"
        f"  API key:          {api_key}\n"
        f"  Models:           {', '.join(models) if models else none_yet}\n"
        f"  Admin API:        {admin_url}/admin/v1   (OpenAPI: {admin_url}/docs)\n"
        f"  Admin token:      {admin_token}\n"
        f"  Console:          {console_url(admin_url)}   (sign in with the admin token)\n"
        f"  Data dir:         {data_dir}   (up.json there holds all of this for scripts)\n"
        f"  Status:           {commands.llmgw} status{data_flag}\n"
        f"{metrics}"
        f"  Database:         {psql}\n"
        "\nTry it (copy and paste):\n\n"
        + (
            _examples(base_url, api_key, models, commands)
            if models
            else _list_models(base_url, api_key)
        )
        + "\nPress Ctrl-C to stop (engines, agent, gateway, control plane, then Postgres).\n"
    )


def _list_models(base_url: str, api_key: str) -> str:
    auth = shlex.quote("Authorization: Bearer " + api_key)
    return f"curl -sS {base_url}/models -H {auth}; echo\n"


def _examples(base_url: str, api_key: str, models: list[str], commands: Commands) -> str:
    """curl and the openai client, each plain and streaming; the stream uses the second name
    (the demo's LoRA adapter)."""
    model = models[0]
    lora = models[1] if len(models) > 1 else model
    chat = json.dumps(
        {
            "model": model,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "Say hello in five words."}],
        }
    )
    stream = json.dumps(
        {
            "model": lora,
            "stream": True,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "Write one SQL query."}],
        }
    )
    q = shlex.quote
    auth = q("Authorization: Bearer " + api_key)
    return (
        f"curl -sS {base_url}/chat/completions -H {auth} \\\n"
        f"  -H 'Content-Type: application/json' -d {q(chat)}; echo\n"
        f"curl -sSN {base_url}/chat/completions -H {auth} \\\n"
        f"  -H 'Content-Type: application/json' -d {q(stream)}\n"
        + _openai_client(commands)
        + f"{q(commands.python)} - <<'PY'\n"
        "from openai import OpenAI\n"
        f"client = OpenAI(base_url={base_url!r}, api_key={api_key!r})\n"
        f"reply = client.chat.completions.create(model={model!r}, max_tokens=32, "
        'messages=[{"role": "user", "content": "Say hello in five words."}])\n'
        "print(reply.choices[0].message.content)\n"
        f"for chunk in client.chat.completions.create(model={lora!r}, stream=True, max_tokens=32, "
        'messages=[{"role": "user", "content": "Write one SQL query."}]):\n'
        "    if chunk.choices:\n"
        '        print(chunk.choices[0].delta.content or "", end="", flush=True)\n'
        "print()\n"
        "PY\n"
    )


def _openai_client(commands: Commands) -> str:
    # The interpreter is named by its path: `python3` would be the system's, without the
    # client (ModuleNotFoundError). Where the client is missing (an install without the dev
    # extra), the snippet installs it into that same environment first.
    if commands.has_openai:
        return "# the openai client, with the Python of llmgw's environment\n"
    return (
        "# the openai client, installed into llmgw's environment\n"
        f"{shlex.quote(commands.python)} -m pip install -q openai\n"
    )
