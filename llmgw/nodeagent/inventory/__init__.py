"""What a node has, behind one interface: NVML on GPU machines, a file or simulated GPUs elsewhere.

`GpuSource` is the hardware boundary (docs/architecture.md §10: only hardware is faked, and
the fake is driven by data). Everything else about the node (CPU threads,
memory, fabrics, installed engines) is read by `collect_inventory` the same
way whatever the GPU source.
"""

from llmgw.nodeagent.inventory.base import GpuSource, mig_index
from llmgw.nodeagent.inventory.file import FileGpuSource, load_inventory_file
from llmgw.nodeagent.inventory.host import (
    allowed_cpus,
    check_fabrics,
    collect_inventory,
    cpu_threads,
    installed_engines,
    memory_total_mb,
)
from llmgw.nodeagent.inventory.nvml import NvmlGpuSource
from llmgw.nodeagent.inventory.simulated import SIM_GPU_CLASS, SimulatedGpuSource

__all__ = [
    "SIM_GPU_CLASS",
    "FileGpuSource",
    "GpuSource",
    "NvmlGpuSource",
    "SimulatedGpuSource",
    "allowed_cpus",
    "check_fabrics",
    "collect_inventory",
    "cpu_threads",
    "installed_engines",
    "load_inventory_file",
    "memory_total_mb",
    "mig_index",
]
