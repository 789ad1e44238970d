"""The node's local policy: what it agrees to run, whatever the control plane sends.

The control plane validates profiles, but the agent runs engines as its own
user on hardware it answers for, so it checks again with rules only its
operator sets: model roots, engines, refused flags (`--trust-remote-code`
runs a model repository's Python), adapter sources, and that simulated GPUs
only ever run the simulator. A refusal fails that shard alone, with a reason
naming the rule and the setting that would allow it.

This module must NOT do I/O beyond normalising paths.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from llmgw.engines import Engine, ShardSpec
from llmgw.errors import SpecError

__all__ = ["LocalPolicy", "adapter_source_problem", "check_policy", "under_root"]


@dataclass(frozen=True, slots=True)
class LocalPolicy:
    allowed_model_roots: tuple[str, ...] = ()
    allowed_engines: tuple[str, ...] = ()
    refused_flags: tuple[str, ...] = ("--trust-remote-code",)
    allowed_adapter_sources: tuple[str, ...] = ()

    @property
    def adapter_roots(self) -> tuple[str, ...]:
        local = tuple(s for s in self.allowed_adapter_sources if not _is_url(s))
        return local if self.allowed_adapter_sources else self.allowed_model_roots

    @property
    def adapter_url_prefixes(self) -> tuple[str, ...]:
        return tuple(s for s in self.allowed_adapter_sources if _is_url(s))


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://"))


def under_root(path: str, roots: Sequence[str]) -> bool:
    """Whether `path`, normalised (`..` folded), sits under one of `roots`.

    Normalising without touching the disk: a symlink under a root that points
    outside is the root owner's decision, and the node's operator owns the roots.
    """
    if not os.path.isabs(path):
        return False
    norm = os.path.normpath(path)
    for root in roots:
        r = os.path.normpath(root)
        if norm == r or norm.startswith(r.rstrip("/") + "/"):
            return True
    return False


def check_policy(
    spec: ShardSpec,
    engine: Engine,
    policy: LocalPolicy,
    *,
    simulated_gpus: Collection[int] = (),
) -> None:
    """Raise SpecError naming the rule a shard breaks, or return."""
    p = spec.profile
    if policy.allowed_engines and p.engine not in policy.allowed_engines:
        raise SpecError(
            f"shard {spec.shard_id}: engine {p.engine!r} is not allowed on this node (have "
            f"{', '.join(policy.allowed_engines)}; agent.policy.allowed_engines)",
            field="profile.engine",
        )
    on_sim = sorted(set(spec.gpu_indices) & set(simulated_gpus))
    if on_sim and p.engine != "sim":
        raise SpecError(
            f"shard {spec.shard_id}: GPUs {on_sim} are simulated (class sim); only the sim "
            f"engine runs on them, not {p.engine!r}",
            field="gpu_indices",
        )
    # The simulator reads no model files: its model path is only a name.
    if (
        p.engine != "sim"
        and policy.allowed_model_roots
        and not under_root(p.model_path, policy.allowed_model_roots)
    ):
        raise SpecError(
            f"shard {spec.shard_id}: model path {p.model_path!r} is not under an allowed "
            f"root ({', '.join(policy.allowed_model_roots)}; agent.policy.allowed_model_roots)",
            field="profile.model_path",
        )
    if policy.refused_flags:
        bad = engine.refused_flags(p.args, policy.refused_flags)
        if bad:
            raise SpecError(
                f"shard {spec.shard_id}: args {bad} are refused on this node "
                f"(agent.policy.refused_flags: {', '.join(policy.refused_flags)})",
                field="profile.args",
            )
    for a in p.adapters:
        problem = adapter_source_problem(a.name, a.path, policy)
        if problem is not None:
            raise SpecError(f"shard {spec.shard_id}: {problem}", field="profile.adapters")


def adapter_source_problem(name: str, path: str, policy: LocalPolicy) -> str | None:
    """Why this node refuses a LoRA adapter from ``path`` (a directory, or an http(s) source
    it would download), or None: the one rule for a profile's adapters and the runtime
    adapters the leader places (adapter_sync.py)."""
    if _is_url(path):
        if not any(path.startswith(pre) for pre in policy.adapter_url_prefixes):
            return (
                f"adapter {name!r} source {path!r} is not an allowed download "
                "(agent.policy.allowed_adapter_sources lists the URL prefixes this node "
                "fetches from)"
            )
    elif policy.adapter_roots and not under_root(path, policy.adapter_roots):
        return (
            f"adapter {name!r} path {path!r} is not under an allowed root "
            f"({', '.join(policy.adapter_roots)}; agent.policy.allowed_adapter_sources)"
        )
    return None
