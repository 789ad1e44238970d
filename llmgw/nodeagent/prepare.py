"""From a desired shard to the exact launch: parse, check against the node, fill in what only
the node knows, build the commands.

Two steps, so that a bad spec fails before anything is touched:
- `prepare` runs on every changed desired set: it parses the spec, checks it
  against this node (GPUs, local policy, secret references, the model's
  config.json where the engine asks for it) and builds the commands once with
  placeholder ports, so every error the launch could raise is found now and
  reported for this shard alone;
- `build_launch` runs when the shard is (re)started: it fills in the
  allocated ports and CPU cores, resolves the secrets and builds the commands
  for real.

The digest is what adoption and the diff compare. It covers the desired
shard as the control plane sent it (fingerprint, spec, a hash of the API
key) and nothing the agent derives, so a newer agent that builds commands
differently never restarts an engine that still matches its desired spec.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.engines import Command, Engine, EngineRegistry, ShardSpec, parse_shard_spec
from llmgw.errors import SpecError
from llmgw.nodeagent.policy import LocalPolicy, check_policy
from llmgw.nodeagent.secrets import resolve_secret_refs
from llmgw.protocol import DesiredShard, FabricInfo, GpuDevice

__all__ = [
    "LaunchPorts",
    "NodeFacts",
    "PreparedShard",
    "build_launch",
    "launch_digest",
    "prepare",
    "secret_values",
    "spec_without_secrets",
    "stored_spec",
]

# Fields of ShardSpec the agent fills in; the control plane's values are ignored.
AGENT_FIELDS = (
    "http_port",
    "kv_events_port",
    "kv_replay_port",
    "bind_addr",
    "node_addr",
    "runtime_dir",
    "api_key",
    "secret_env",
    "cpu_cores",
)
_PLACEHOLDER_PORTS = (1, 2, 3)
# A model's config.json is a few kB; anything near this is no config to read on the agent's loop.
_MAX_MODEL_CONFIG_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What preparing a launch needs to know about this node."""

    gpus: tuple[GpuDevice, ...]
    fabrics: tuple[FabricInfo, ...]
    mgmt_addr: str
    bind_addr: str
    policy: LocalPolicy
    environ: Mapping[str, str]
    base_env: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class LaunchPorts:
    http_port: int
    kv_events_port: int = 0
    kv_replay_port: int = 0


@dataclass(frozen=True, slots=True)
class PreparedShard:
    desired: DesiredShard
    digest: str
    # None when the spec could not even be parsed (error says why).
    spec: ShardSpec | None
    engine: Engine | None
    # Non-empty: the node will not launch this spec.
    error: str = ""

    @property
    def shard_id(self) -> str:
        return self.desired.shard_id

    @property
    def launchable(self) -> bool:
        return not self.error

    @property
    def needs_kv_ports(self) -> bool:
        return self.spec is not None and self.spec.profile.kv_events and self.spec.leader

    @property
    def suspendable(self) -> bool:
        return (
            self.engine is not None
            and self.spec is not None
            and self.engine.can_suspend(self.spec.profile)
        )


def stored_spec(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The spec as the control plane sent it, minus the fields that may carry secrets."""
    return {k: v for k, v in raw.items() if k not in ("api_key", "secret_env")}


def launch_digest(desired: DesiredShard) -> str:
    """What must match for a running engine to count as running this desired shard."""
    view = {
        "fingerprint": desired.fingerprint,
        "spec": {k: v for k, v in stored_spec(desired.spec).items() if k not in AGENT_FIELDS},
        "secret_env_refs": desired.spec.get("secret_env") or {},
        # A rotated key must reach the engine, which reads it at start. The
        # key is a random token, so its hash reveals nothing.
        "key": hashlib.sha256(desired.engine_api_key.encode()).hexdigest(),
        "v": 1,
    }
    text = json.dumps(view, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _secret_refs(spec: ShardSpec, raw: Mapping[str, Any]) -> dict[str, str]:
    # References come from the profile (the control plane never resolves
    # them); a spec-level secret_env may only hold references too.
    refs = dict(spec.profile.secret_env)
    extra = raw.get("secret_env") or {}
    if isinstance(extra, dict):
        refs.update({str(k): str(v) for k, v in extra.items()})
    return refs


def _fill(
    spec: ShardSpec,
    desired: DesiredShard,
    facts: NodeFacts,
    ports: LaunchPorts,
    *,
    runtime_dir: str,
    secret_env: Mapping[str, str],
    cpu_cores: tuple[int, ...] = (),
) -> ShardSpec:
    by_index = {g.index: g for g in facts.gpus}
    missing = [i for i in spec.gpu_indices if i not in by_index]
    if missing:
        raise SpecError(
            f"shard {spec.shard_id}: GPU indices {missing} do not exist on this node "
            f"(have {sorted(by_index) or 'none'})",
            field="gpu_indices",
        )
    update: dict[str, Any] = {
        "http_port": ports.http_port,
        "kv_events_port": ports.kv_events_port,
        "kv_replay_port": ports.kv_replay_port,
        "bind_addr": facts.bind_addr,
        "node_addr": facts.mgmt_addr,
        "runtime_dir": runtime_dir,
        "api_key": desired.engine_api_key,
        "secret_env": dict(secret_env),
        "cpu_cores": cpu_cores,
    }
    devices = [by_index[i] for i in spec.gpu_indices]
    # CUDA addresses a MIG instance only as MIG-<uuid>; then every device of
    # the shard is named by UUID, in the same order (spec.py).
    if any(d.mig_parent_uuid for d in devices):
        update["gpu_uuids"] = tuple(d.uuid for d in devices)
    if spec.fabric and spec.gid_index is None:
        fabric = next((f for f in facts.fabrics if f.name == spec.fabric), None)
        if fabric is not None and fabric.kind == "roce" and fabric.gid_index is not None:
            update["gid_index"] = fabric.gid_index
    return spec.model_copy(update=update)


def prepare(desired: DesiredShard, registry: EngineRegistry, facts: NodeFacts) -> PreparedShard:
    """Parse and check one desired shard; never raises."""
    digest = launch_digest(desired)
    raw = dict(desired.spec)
    try:
        # The key travels beside the spec, never in it.
        spec = parse_shard_spec({**stored_spec(raw), "api_key": ""})
    except SpecError as e:
        return PreparedShard(desired, digest, None, None, e.message)
    if spec.shard_id != desired.shard_id or spec.replica_id != desired.replica_id:
        return PreparedShard(
            desired,
            digest,
            spec,
            None,
            f"spec names shard {spec.shard_id!r} of replica {spec.replica_id!r}, the desired "
            f"shard is {desired.shard_id!r} of {desired.replica_id!r}",
        )
    try:
        engine = registry.get(spec.profile.engine)
    except SpecError as e:
        return PreparedShard(desired, digest, spec, None, e.message)
    try:
        simulated = [g.index for g in facts.gpus if g.simulated]
        check_policy(spec, engine, facts.policy, simulated_gpus=simulated)
        _check_model_config(spec, engine)
        secrets = resolve_secret_refs(_secret_refs(spec, raw), facts.environ)
        kv = spec.profile.kv_events and spec.leader
        placeholder = LaunchPorts(
            _PLACEHOLDER_PORTS[0],
            _PLACEHOLDER_PORTS[1] if kv else 0,
            _PLACEHOLDER_PORTS[2] if kv else 0,
        )
        filled = _fill(spec, desired, facts, placeholder, runtime_dir="/", secret_env=secrets)
        engine.commands(filled, base_env=facts.base_env)
    except SpecError as e:
        return PreparedShard(desired, digest, spec, engine, e.message)
    return PreparedShard(desired, digest, spec, engine)


def _check_model_config(spec: ShardSpec, engine: Engine) -> None:
    """Hand the engine the model's config.json where it asks for it and the file can be read
    here, so a model it would load but fail to serve (vLLM's CPU attention and heads under 32
    dimensions: 500s from the first request on) is refused before it starts. A model path that
    is no directory on this node (a hub id), or a config that cannot be read or parsed, is left
    to the engine, which reports its own error at start."""
    p = spec.profile
    if not engine.wants_model_config(p) or not os.path.isabs(p.model_path):
        return
    try:
        with (Path(p.model_path) / "config.json").open("rb") as f:
            raw = f.read(_MAX_MODEL_CONFIG_BYTES + 1)
    except OSError:
        return
    if len(raw) > _MAX_MODEL_CONFIG_BYTES:
        return
    try:
        config = json.loads(raw)
    except ValueError:
        return
    if isinstance(config, dict):
        engine.check_model_config(p, config)


def build_launch(
    prepared: PreparedShard,
    facts: NodeFacts,
    ports: LaunchPorts,
    *,
    runtime_dir: str,
    cpu_cores: tuple[int, ...] = (),
) -> tuple[ShardSpec, list[Command]]:
    """The filled spec and its commands, secrets resolved; SpecError if that now fails.
    ``cpu_cores``: the cores the launcher picked for a CPU shard (cores.py)."""
    if prepared.spec is None or prepared.engine is None or prepared.error:
        raise SpecError(prepared.error or f"shard {prepared.shard_id}: not launchable")
    secrets = resolve_secret_refs(_secret_refs(prepared.spec, prepared.desired.spec), facts.environ)
    spec = _fill(
        prepared.spec,
        prepared.desired,
        facts,
        ports,
        runtime_dir=runtime_dir,
        secret_env=secrets,
        cpu_cores=cpu_cores,
    )
    return spec, prepared.engine.commands(spec, base_env=facts.base_env)


def spec_without_secrets(spec: ShardSpec) -> dict[str, Any]:
    """A filled spec as a record stores it."""
    return spec.model_dump(mode="json", exclude={"api_key", "secret_env"})


def secret_values(spec: ShardSpec) -> Sequence[str]:
    return [v for v in (spec.api_key, *spec.secret_env.values()) if v]
