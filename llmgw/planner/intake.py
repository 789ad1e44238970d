"""The rules by which stored state becomes a snapshot, where reading it takes a rule.

Which reported GPUs and fabrics placement may use, what counts as a node's evidence of life,
what a profile the engines package refuses asks for and keeps, and how the GPU classes admins
stored join the configured ones. The store (``store/reconcile/read.py``) reads rows and
calls these to build the views; it decides nothing itself, so every rule a pass applies to
what it read is here, beside the planner that relies on it.

Pure: no database, no I/O, no environment; inventories arrive as the JSON the agents sent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from llmgw.engines import Profile as EngineProfile
from llmgw.engines import placement_requirements, reference_engine
from llmgw.errors import LlmgwError
from llmgw.planner.snapshot import (
    GPU,
    SIM_GPU_CLASS,
    DeploymentId,
    DeploymentView,
    Fabric,
    FabricName,
    PlacementRequirements,
    PlanSettings,
    ReplicaView,
)

__all__ = [
    "Device",
    "Inventory",
    "Launch",
    "evidence_of_life",
    "freeze_unlaunchable",
    "launch_of",
    "placeable",
    "with_gpu_classes",
]

# A device as gpu_assignments records it: (physical GPU index, MIG uuid or None).
Device = tuple[int, str | None]


@dataclass(frozen=True, slots=True)
class Inventory:
    """What placement may use of a node's reported inventory, and where its keys lead."""

    gpus: tuple[GPU, ...] = ()
    fabrics: tuple[Fabric, ...] = ()
    cpu_threads: int = 0
    # Placement's GPU key ("3", "MIG-<uuid>") -> the device it stands for.
    devices: Mapping[str, Device] = field(default_factory=dict)
    # Fabric name -> the GID index the agent reported for it (None: it gave none).
    gid_index: Mapping[str, int | None] = field(default_factory=dict)

    def placement_index(self) -> dict[Device, int]:
        """Device -> the index placement knows it by (MIG instances are numbered from 1000
        up; CUDA gives them none)."""
        index_of_key = {g.key: g.index for g in self.gpus}
        return {device: index_of_key[key] for key, device in self.devices.items()}


def placeable(inventory: Mapping[str, Any]) -> Inventory:
    """What placement may use of an agent's inventory (llmgw.protocol.NodeInventory as JSON;
    empty for a node that never reported)."""
    gpus, devices = _gpus(inventory)
    fabrics, gid_index = _fabrics(inventory)
    return Inventory(
        gpus=gpus,
        fabrics=fabrics,
        cpu_threads=int(inventory.get("cpu_threads") or 0),
        devices=devices,
        gid_index=gid_index,
    )


def _gpus(inventory: Mapping[str, Any]) -> tuple[tuple[GPU, ...], dict[str, Device]]:
    devices = [d for d in inventory.get("gpus") or [] if isinstance(d, dict)]
    index_of_uuid = {d.get("uuid"): d.get("index") for d in devices if d.get("uuid")}
    gpus: list[GPU] = []
    keys: dict[str, Device] = {}
    for d in devices:
        if d.get("mig_enabled"):
            continue  # carved into instances: only those are placeable
        parent_uuid = d.get("mig_parent_uuid") or ""
        parent = index_of_uuid.get(parent_uuid) if parent_uuid else None
        if parent_uuid and parent is None:
            continue  # an instance of a GPU the agent did not list: nothing safe to key it on
        # Simulated GPUs go by the class they resolve to, so no pattern can match a real class.
        name = SIM_GPU_CLASS if d.get("simulated") else str(d.get("name") or "")
        gpu = GPU(
            index=int(d["index"]), name=name, uuid=str(d.get("uuid") or ""), mig_parent=parent
        )
        gpus.append(gpu)
        keys[gpu.key] = (int(parent), gpu.key) if parent is not None else (gpu.index, None)
    return tuple(gpus), keys


def _fabrics(inventory: Mapping[str, Any]) -> tuple[tuple[Fabric, ...], dict[str, int | None]]:
    fabrics: list[Fabric] = []
    gid: dict[str, int | None] = {}
    for f in inventory.get("fabrics") or []:
        if not isinstance(f, dict) or not f.get("present", True):
            continue  # an HCA the config names is missing: never place a multi-node replica on it
        fabrics.append(Fabric(name=FabricName(str(f["name"])), hcas=tuple(f.get("hcas") or ())))
        gid[str(f["name"])] = f.get("gid_index")
    return tuple(fabrics), gid


def evidence_of_life(
    last_sync_at: datetime | None, observing_since: datetime | None
) -> datetime | None:
    """When a node was last known alive: what the planner reads as ``NodeView.last_sync_at``.

    ``observing_since``: when the caller began watching the fleet without a gap (it took
    the lead, or its passes work again after a failure). A node is judged silent only by
    what happened since then: after an outage of the control planes or Postgres, every
    node's last sync is old through no fault of its own, and a leader that counted that
    silence would replace every replica of the fleet before a single agent could sync.
    """
    # A node that never synced stays unknown: it has earned no grace.
    if last_sync_at is None or observing_since is None:
        return last_sync_at
    return max(last_sync_at, observing_since)


@dataclass(frozen=True, slots=True)
class Launch:
    """What a deployment's stored profile gives a pass."""

    # The engines' Profile its replicas launch from; None when the engines package refuses it.
    profile: EngineProfile | None
    requirements: PlacementRequirements
    # Why it cannot be launched, for the deployment's status; "" when it can.
    refusal: str = ""
    # Why its engine cannot suspend its replicas (Engine.suspend_refusal); "" when it can.
    suspend_refusal: str = ""


def launch_of(name: str, gpu_class: str, build: Callable[[], EngineProfile]) -> Launch:
    """The profile ``build`` makes of the stored row, and what placement must find for it.

    A profile the engines package refuses (a newer llmgw's rule, a hand-edited row) must not
    stop the fleet's reconcile: it is named in the deployment's status, gets no new replicas
    (``freeze_unlaunchable``) and keeps requirements of its GPU class for the ones it has.
    """
    try:
        profile = build()
        return Launch(
            profile=profile,
            requirements=placement_requirements(profile),
            suspend_refusal=reference_engine(profile.engine).suspend_refusal(profile),
        )
    except (LlmgwError, ValueError) as exc:
        return Launch(
            profile=None,
            requirements=PlacementRequirements(
                gpu_class=gpu_class,
                nodes=1,
                gpus_per_node=1,
                threads=0,
                cpu_only=False,
                mig_allowed=False,
                same_gpu_indices_across_nodes=False,
                same_hcas_across_nodes=False,
            ),
            refusal=f"profile {name!r} cannot be launched: {exc}",
        )


def freeze_unlaunchable(
    deployments: Sequence[DeploymentView],
    replicas: Iterable[ReplicaView],
    unlaunchable: Collection[DeploymentId],
) -> tuple[DeploymentView, ...]:
    """A deployment whose profile cannot be launched gets no new replicas and loses none: its
    desired count is frozen at the active replicas it has until an admin fixes the profile."""
    if not unlaunchable:
        return tuple(deployments)
    live: dict[DeploymentId, int] = {}
    for r in replicas:
        if r.deployment_id is not None and r.state == "active":
            live[r.deployment_id] = live.get(r.deployment_id, 0) + 1
    return tuple(
        replace(d, replicas=live.get(d.id, 0)) if d.id in unlaunchable else d for d in deployments
    )


def with_gpu_classes(settings: PlanSettings, stored: Sequence[tuple[str, str]]) -> PlanSettings:
    """``settings`` with the GPU classes admins stored, as (name, pattern): a stored class
    overrides the configured pattern of the same name."""
    if not stored:
        return settings
    patterns = dict(settings.gpu_class_patterns)
    patterns.update(stored)
    return replace(settings, gpu_class_patterns=tuple(sorted(patterns.items())))
