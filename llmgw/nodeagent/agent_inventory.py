"""What the agent reports of its node: the GPU source its settings pick, and the inventory read
through it (again every 30 s, for XID/ECC counters and a GPU that fell off the bus).

One GPU source per agent: NVML where it loads, else simulated GPUs (--sim-gpus) or an
inventory file; a machine with neither reports no GPUs and says how to describe them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from llmgw.config import AgentSettings
from llmgw.engines import EnginesConfig
from llmgw.errors import ConfigError
from llmgw.logs import get_logger
from llmgw.nodeagent.inventory import (
    FileGpuSource,
    GpuSource,
    NvmlGpuSource,
    SimulatedGpuSource,
    collect_inventory,
    load_inventory_file,
)
from llmgw.nodeagent.inventory.file import InventoryFile
from llmgw.protocol import FabricInfo, NodeInventory

__all__ = ["NodeInventoryReader", "agent_version", "gpu_source"]

log = get_logger("llmgw.nodeagent")

# How often the inventory is read again (XID/ECC counters, a GPU that fell off the bus).
_INVENTORY_REFRESH_S = 30.0


@functools.cache  # read from the installed metadata once, not at every inventory read
def agent_version() -> str:
    try:
        from importlib.metadata import version

        return version("llmgw")
    except Exception:
        return "0+unknown"


def gpu_source(s: AgentSettings, *, node_name: str) -> GpuSource:
    """The GPU source the settings name (ConfigError when they name two)."""
    if s.sim_gpus and s.inventory_file:
        raise ConfigError(
            "--sim-gpus and --inventory-file both describe the GPUs; pass one",
            field="agent.sim_gpus",
        )
    if s.sim_gpus:
        return SimulatedGpuSource(s.sim_gpus, node_name=node_name)
    if s.inventory_file:
        return FileGpuSource(load_inventory_file(s.inventory_file))
    try:
        return NvmlGpuSource()
    except ConfigError:
        log.warning(
            "nvml_unavailable",
            hint="no GPUs reported; use --sim-gpus N or --inventory-file on CPU machines",
        )
        return FileGpuSource(InventoryFile())


class NodeInventoryReader:
    """The node's inventory: read at start (``inventory``), read again when ``current`` finds
    it older than 30 s. Owns the GPU source (``close``)."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        node_name: str,
        engines: EnginesConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._engines = engines
        self._clock = clock
        self.gpu_source = gpu_source(settings, node_name=node_name)
        # What the inventory file adds beyond its GPUs: fabrics, CPU threads and memory.
        self._file_fabrics: list[FabricInfo] = []
        self._file_threads: int | None = None
        self._file_memory_mb: int | None = None
        if settings.inventory_file:
            inv_file = load_inventory_file(settings.inventory_file)
            self._file_fabrics = inv_file.fabric_infos()
            self._file_threads, self._file_memory_mb = (
                inv_file.cpu_threads,
                inv_file.memory_total_mb,
            )
        self.inventory: NodeInventory = self._collect()
        self._read_at = self._clock()

    def _collect(self) -> NodeInventory:
        fabrics = [
            FabricInfo(name=f.name, kind=f.kind, hcas=tuple(f.hcas), gid_index=f.gid_index)
            for f in self._settings.fabrics
        ]
        return collect_inventory(
            self.gpu_source,
            fabrics=[*fabrics, *self._file_fabrics],
            engines=self._engines,
            llmgw_version=agent_version(),
            cpu_threads_override=self._settings.cpu_threads or self._file_threads,
            memory_override_mb=self._file_memory_mb,
        )

    def current(self) -> NodeInventory:
        if self._clock() - self._read_at > _INVENTORY_REFRESH_S:
            self.inventory = self._collect()
            self._read_at = self._clock()
        return self.inventory

    def close(self) -> None:
        self.gpu_source.close()
