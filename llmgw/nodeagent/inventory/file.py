"""A file-driven inventory for CPU-only machines and tests: GPUs, MIG instances, fabrics.

    gpus:
      - index: 0
        uuid: GPU-1b2c...
        name: NVIDIA H100 80GB HBM3
        memory_total_mb: 81559
        compute_capability: "9.0"
        mig:                       # optional: MIG enabled, these instances exist
          - {uuid: MIG-4d5e..., profile: 3g.40gb, memory_total_mb: 40192}
    fabrics:
      - {name: ib0, kind: ib, hcas: [mlx5_0, mlx5_1]}
    cpu_threads: 64                # optional: overrides what the host reports
    memory_total_mb: 1031000       # optional

A mistake in the file fails the agent's start naming the entry: a node that
advertises GPUs it does not have gets replicas that never start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw.errors import ConfigError
from llmgw.nodeagent.inventory.base import mig_index
from llmgw.protocol import FabricInfo, GpuDevice

__all__ = ["FileGpuSource", "InventoryFile", "load_inventory_file"]


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MigEntry(_File):
    uuid: str = Field(min_length=1)
    profile: str = Field(min_length=1, description='"1g.10gb"')
    memory_total_mb: int = Field(default=0, ge=0)


class GpuEntry(_File):
    index: int = Field(ge=0, lt=1000)
    uuid: str = ""
    name: str = Field(min_length=1)
    # Defaults to name: what profiles call this kind of GPU.
    gpu_class: str = ""
    memory_total_mb: int = Field(default=0, ge=0)
    compute_capability: str = ""
    mig: list[MigEntry] = Field(default_factory=list, max_length=99)


class FabricEntry(_File):
    name: str = Field(min_length=1)
    kind: Literal["ib", "roce", "nvl"]
    hcas: list[str] = Field(default_factory=list)
    gid_index: int | None = None


class InventoryFile(_File):
    gpus: list[GpuEntry] = Field(default_factory=list)
    fabrics: list[FabricEntry] = Field(default_factory=list)
    cpu_threads: int | None = Field(default=None, ge=0)
    memory_total_mb: int | None = Field(default=None, ge=0)

    def devices(self) -> list[GpuDevice]:
        out: list[GpuDevice] = []
        for g in self.gpus:
            out.append(
                GpuDevice(
                    index=g.index,
                    uuid=g.uuid,
                    name=g.name,
                    gpu_class=g.gpu_class or g.name,
                    memory_total_mb=g.memory_total_mb,
                    compute_capability=g.compute_capability,
                    mig_enabled=bool(g.mig),
                )
            )
            for i, m in enumerate(g.mig):
                name = f"{g.name} MIG {m.profile}"
                out.append(
                    GpuDevice(
                        index=mig_index(g.index, i),
                        uuid=m.uuid,
                        name=name,
                        gpu_class=name,
                        memory_total_mb=m.memory_total_mb,
                        compute_capability=g.compute_capability,
                        mig_parent_uuid=g.uuid,
                    )
                )
        return out

    def fabric_infos(self) -> list[FabricInfo]:
        return [
            FabricInfo(name=f.name, kind=f.kind, hcas=tuple(f.hcas), gid_index=f.gid_index)
            for f in self.fabrics
        ]


def load_inventory_file(path: str | Path) -> InventoryFile:
    """Parse an inventory file (YAML or JSON) or raise ConfigError naming the problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(
            f"inventory file {str(p)!r} cannot be read: {e.strerror}; pass --inventory-file "
            "with the path of a YAML or JSON inventory",
            field="agent.inventory_file",
        ) from None
    try:
        data: Any = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(
            f"inventory file {str(p)!r} is not valid YAML/JSON: {e}", field="agent.inventory_file"
        ) from None
    try:
        inv = InventoryFile.model_validate(data or {})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '(top level)'}: {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(
            f"inventory file {str(p)!r} is invalid: {problems}", field="agent.inventory_file"
        ) from None
    indices = [g.index for g in inv.gpus]
    if len(set(indices)) != len(indices):
        raise ConfigError(
            f"inventory file {str(p)!r} lists GPU index "
            f"{sorted(i for i in indices if indices.count(i) > 1)[0]} twice; each GPU once",
            field="agent.inventory_file",
        )
    return inv


class FileGpuSource:
    source_name = "file"

    def __init__(self, inventory: InventoryFile) -> None:
        self._devices = inventory.devices()

    def gpus(self) -> list[GpuDevice]:
        return list(self._devices)

    def pids_on(self, indices: list[int]) -> set[int]:
        # A file describes GPUs nothing can run on: no process ever holds one.
        return set()

    def close(self) -> None:
        return None
