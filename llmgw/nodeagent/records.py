"""Per-shard records on disk: what an agent that restarts needs to adopt its engines.

Layout under the state dir:

    shards/<shard_id>/record.json   ShardRecord, written by the agent
    shards/<shard_id>/procs.json    ShardProcs, written by the wrapper once its commands run
                                    (and its front door listens)
    shards/<shard_id>/exit.json     ShardExit, written by the wrapper when the shard ends
    shards/<shard_id>/adapters.json ShardAdapters, the runtime LoRA adapters the agent last
                                    knew the engine to hold (adapter_sync.py)
    shards/<shard_id>/logs/         the commands' output, rotated by the wrapper
    shards/<shard_id>/run/          the shard's runtime dir (Command.files)

Every file is written atomically (temp file, fsync, rename, fsync of the
directory), so a crash or `kill -9` mid-write leaves the old or the new
version, never half of one. A record that is still unreadable (disk trouble,
a hand edit) fails only that shard: `read_record` raises `RecordError` and
the agent reports the shard and runs on.

No record holds a secret: the spec is stored without api_key and with the
secret_env *references*, never their values, since the state dir is backed up
and read by people debugging.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

__all__ = [
    "RECORD_VERSION",
    "RecordError",
    "ShardAdapters",
    "ShardExit",
    "ShardProc",
    "ShardProcs",
    "ShardRecord",
    "ShardSpecView",
    "atomic_write",
    "list_shard_dirs",
    "mark_stopped",
    "read_adapters",
    "read_exit",
    "read_procs",
    "read_record",
    "safe_shard_dirname",
    "write_model",
]

RECORD_VERSION = 1
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RecordError(Exception):
    """A shard's record cannot be read or parsed."""


@dataclass(frozen=True, slots=True)
class ShardSpecView:
    """The fields of a record's stored spec (a ShardSpec as launched, as JSON) the agent reads,
    parsed once when the record is (``ShardRecord.spec_view``): the spec itself stays a dict,
    since a record written by another agent version must load whatever its spec holds.

    A field the spec lacks reads as ShardSpec's default; one of the wrong type makes the record
    unreadable (``RecordError``), as any other bad field does."""

    # Node rank; 0 is the leader and the only rank that serves HTTP.
    rank: int = 0
    # Where the engine's HTTP server listens; empty: 127.0.0.1.
    bind_addr: str = ""
    gpu_indices: tuple[int, ...] = ()
    # The cores the agent bound a CPU shard to (cores.py); empty for any other shard.
    cpu_cores: tuple[int, ...] = ()
    # The profile's served_model_name (empty when it sets none).
    served_model_name: str = ""
    # The profile's adapter_slots and the names of its own adapters (loaded at start): what the
    # running engine was started with, which is what its runtime adapters are converged within
    # (adapter_sync.py), whatever a newer desired spec says. Read leniently: a record is never
    # made unreadable by them.
    adapter_slots: int = 0
    adapter_names: tuple[str, ...] = ()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def engine_host(self) -> str:
        """The host the engine's HTTP server is reached at on this node."""
        return self.bind_addr or "127.0.0.1"

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> ShardSpecView:
        """Raises ValueError or TypeError for a field of the wrong type."""
        profile = spec.get("profile")
        served = profile.get("served_model_name") if isinstance(profile, Mapping) else None
        indices = spec.get("gpu_indices") or ()
        if not isinstance(indices, list | tuple):
            raise TypeError(f"gpu_indices is {type(indices).__name__}, not a list")
        cores = spec.get("cpu_cores") or ()
        if not isinstance(cores, list | tuple):
            raise TypeError(f"cpu_cores is {type(cores).__name__}, not a list")
        slots = profile.get("adapter_slots") if isinstance(profile, Mapping) else None
        adapters = profile.get("adapters") if isinstance(profile, Mapping) else None
        return cls(
            rank=int(spec.get("rank", 0) or 0),
            bind_addr=str(spec.get("bind_addr") or ""),
            gpu_indices=tuple(int(i) for i in indices),
            cpu_cores=tuple(int(c) for c in cores),
            served_model_name=str(served or ""),
            adapter_slots=slots if type(slots) is int and slots > 0 else 0,
            adapter_names=tuple(
                str(a["name"])
                for a in (adapters if isinstance(adapters, list | tuple) else ())
                if isinstance(a, Mapping) and a.get("name")
            ),
        )


class _Rec(BaseModel):
    # Unknown fields are ignored: a record written by a newer agent that was
    # rolled back must still be adoptable.
    model_config = ConfigDict(extra="ignore")


class ShardRecord(_Rec):
    """What the agent started for one shard and how to prove it is still that."""

    version: int = RECORD_VERSION
    shard_id: str
    replica_id: str = ""
    # The desired shard's fingerprint and the agent's digest of the launch
    # (fingerprint + spec + key digest): adoption compares the digest.
    fingerprint: str = ""
    digest: str
    # The ShardSpec as launched, without api_key or resolved secrets.
    spec: dict[str, Any]
    engine: str = ""
    model: str = ""
    # The wrapper: pid and /proc start time within boot_id.
    boot_id: str = ""
    wrapper_pid: int | None = None
    wrapper_start_time: int | None = None
    # Ports the agent allocated; reused when the shard restarts, so a KV
    # listener and an engine PUB keep meeting on the same port.
    http_port: int = 0
    kv_events_port: int = 0
    kv_replay_port: int = 0
    # The front door's port (agent.proxy_port_range_start..end), for a leader that serves
    # HTTP; 0 for other ranks, and in records of agents that served every engine's proxy
    # themselves. Where the wrapper actually listens is in procs.json.
    proxy_port: int = 0
    started_at: float = 0.0
    restarts: int = 0
    # Bumped on every start: the KV relay resets its mirror on a new generation.
    generation: int = 0
    # The engine command's program and the devices it was given, for asking an
    # engine that can fall back to the CPU which GPUs its build sees.
    engine_path: str = ""
    visible_devices: str = ""
    # Why the shard was stopped on purpose and kept for the next agent (its agent exiting
    # with --stop-engines-on-exit, or `llmgw up` stopping what a dead agent left); empty while
    # it runs and after an end of its own. It is what tells a stop that was asked for from a
    # crash: the next start of such a shard reports this reason and is a start, not a restart
    # (`restarts` unchanged), or every Ctrl-C of `llmgw up` would read as a crash.
    stopped_reason: str = ""
    # ``spec`` parsed (set by the validator below; a model_copy keeps it, and no copy
    # replaces the spec).
    _spec_view: ShardSpecView = PrivateAttr(default_factory=ShardSpecView)

    @model_validator(mode="after")
    def _parse_spec(self) -> ShardRecord:
        try:
            self._spec_view = ShardSpecView.parse(self.spec)
        except (TypeError, ValueError) as e:
            # A ValueError is reported as the record's validation error (read_record).
            raise ValueError(f"spec: {e}") from None
        return self

    @property
    def spec_view(self) -> ShardSpecView:
        return self._spec_view


class ShardProc(_Rec):
    name: str
    pid: int
    start_time: int | None = None


class ShardProcs(_Rec):
    """The processes the wrapper started, in command order (the last is the engine)."""

    wrapper_pid: int
    pgid: int | None = None
    procs: list[ShardProc] = Field(default_factory=list)
    # Where the wrapper serves the shard's front door (frontdoor.py): port 0 when its launch
    # asked for none, None from a wrapper too old to serve one (the agent's shared proxy
    # serves such a shard: shared_proxy.py).
    proxy_host: str = ""
    proxy_port: int | None = None


class ShardExit(_Rec):
    """How the shard ended, written by its wrapper."""

    exit_code: int
    # The command whose exit ended the shard; empty when the shard was stopped.
    command: str = ""
    stopped: bool = False
    finished_at: float = 0.0
    # Why the wrapper could not run the shard at all (a bad launch, a leader
    # port that never opened).
    error: str = ""


class ShardAdapters(_Rec):
    """The runtime adapters the agent last knew one engine process to hold, written after each
    load and before each unload (so it never names more than the engine holds). An agent that
    restarts reports them before its first sync, when it cannot ask the engine yet (the
    engine's key comes with the desired set): otherwise its first report would say the engine
    holds none, and the gateways would stop sending it those adapters' requests until the
    next one. Believed only for the process it names (the record's generation and wrapper)."""

    generation: int
    wrapper_pid: int | None = None
    wrapper_start_time: int | None = None
    # Adapter name -> the path the engine loaded it from.
    loaded: dict[str, str] = Field(default_factory=dict)


def safe_shard_dirname(shard_id: str) -> str:
    """The shard id as a directory name; refuses ids that could escape the state dir."""
    if not _SAFE_ID.match(shard_id):
        raise RecordError(
            f"shard id {shard_id!r} cannot name a state directory: it must match "
            f"{_SAFE_ID.pattern} (no slashes, no leading dot)"
        )
    return shard_id


def atomic_write(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Replace `path` with `data` so a crash leaves the old or the new content, whole."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_model(path: Path, model: BaseModel) -> None:
    atomic_write(path, model.model_dump_json().encode())


def _read_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise RecordError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(
            f"{path}: not valid JSON ({e}); the file is truncated or corrupt"
        ) from None


def read_record(shard_dir: Path) -> ShardRecord:
    """The shard's record; FileNotFoundError when there is none, RecordError when unreadable."""
    data = _read_json(shard_dir / "record.json")
    try:
        rec = ShardRecord.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise RecordError(f"{shard_dir / 'record.json'}: {loc}: {first['msg']}") from None
    if rec.shard_id != shard_dir.name:
        raise RecordError(
            f"{shard_dir / 'record.json'}: names shard {rec.shard_id!r} but sits in "
            f"{shard_dir.name!r}; a record is only trusted in its own shard's directory"
        )
    return rec


def mark_stopped(shard_dir: Path, reason: str) -> ShardRecord | None:
    """Note in the shard's record that it is being stopped on purpose (`stopped_reason`); the
    record as written, or None when there is no readable record to note it in."""
    try:
        rec = read_record(shard_dir)
    except (FileNotFoundError, RecordError):
        return None
    rec = rec.model_copy(update={"stopped_reason": reason})
    write_model(shard_dir / "record.json", rec)
    return rec


def read_procs(shard_dir: Path) -> ShardProcs | None:
    try:
        return ShardProcs.model_validate(_read_json(shard_dir / "procs.json"))
    except (FileNotFoundError, RecordError, ValidationError):
        return None


def read_adapters(shard_dir: Path) -> ShardAdapters | None:
    try:
        return ShardAdapters.model_validate(_read_json(shard_dir / "adapters.json"))
    except (FileNotFoundError, RecordError, ValidationError):
        return None


def read_exit(shard_dir: Path) -> ShardExit | None:
    try:
        return ShardExit.model_validate(_read_json(shard_dir / "exit.json"))
    except (FileNotFoundError, RecordError, ValidationError):
        return None


def list_shard_dirs(shards_root: Path) -> list[Path]:
    if not shards_root.is_dir():
        return []
    return sorted(p for p in shards_root.iterdir() if p.is_dir() and not p.name.startswith("."))
