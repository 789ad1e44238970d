"""The node facts that do not come from the GPU source: CPU threads, memory, fabrics, engines."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from llmgw.engines import EngineRegistry, EnginesConfig
from llmgw.nodeagent.inventory.base import GpuSource
from llmgw.protocol import FabricInfo, InstalledEngine, NodeInventory

__all__ = [
    "allowed_cpus",
    "check_fabrics",
    "collect_inventory",
    "cpu_threads",
    "installed_engines",
    "memory_total_mb",
]

SYS_INFINIBAND = Path("/sys/class/infiniband")


def allowed_cpus() -> tuple[int, ...]:
    """The ids of the logical CPUs this process may run on, sorted (a cgroup or taskset may
    allow fewer than exist): what the agent picks CPU shards' cores from."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def cpu_threads() -> int:
    """The logical CPUs this process may run on (a cgroup or taskset may allow fewer than exist)."""
    return len(allowed_cpus())


def memory_total_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_fabrics(fabrics: Sequence[FabricInfo], sys_ib: Path = SYS_INFINIBAND) -> list[FabricInfo]:
    """The fabrics with `present`/`problem` set from /sys/class/infiniband where it exists.

    A configured HCA the kernel does not have makes NCCL fall back to
    sockets or hang; the control plane must see it before placing a
    multi-node replica there. Where the directory does not exist (a
    container without the RDMA devices, a laptop) nothing can be checked,
    and the configuration is taken as written.
    """
    if not sys_ib.is_dir():
        return list(fabrics)
    have = {p.name for p in sys_ib.iterdir()}
    out = []
    for f in fabrics:
        missing = [h for h in f.hcas if h not in have]
        if missing and f.kind != "nvl":
            out.append(
                f.model_copy(
                    update={
                        "present": False,
                        "problem": f"HCAs {', '.join(missing)} are not in {sys_ib} "
                        f"(have {', '.join(sorted(have)) or 'none'})",
                    }
                )
            )
        else:
            out.append(f)
    return out


def installed_engines(config: EnginesConfig, llmgw_version: str) -> list[InstalledEngine]:
    """Each engine the registry knows, where its program is and whether it is disabled.

    Versions are not probed: asking vLLM for its version imports torch (tens
    of seconds). The simulator's version is llmgw's own.
    """
    registry = EngineRegistry(config)
    offered = set(registry.names())
    programs = {
        "vllm": config.vllm.path,
        "sglang": config.sglang.python,
        "llamacpp": config.llamacpp.path,
        "trtllm": config.trtllm.serve_path,
        "megatron": config.megatron.torchrun_path,
        "sim": config.sim.python_executable,
    }
    out = []
    for name, program in sorted(programs.items()):
        path = shutil.which(program) if program else None
        out.append(
            InstalledEngine(
                name=name,
                path=path or "",
                version=llmgw_version if name == "sim" else "",
                disabled=name not in offered or path is None,
            )
        )
    return out


def collect_inventory(
    source: GpuSource,
    *,
    fabrics: Sequence[FabricInfo],
    engines: EnginesConfig,
    llmgw_version: str,
    cpu_threads_override: int | None = None,
    memory_override_mb: int | None = None,
    sys_ib: Path = SYS_INFINIBAND,
) -> NodeInventory:
    return NodeInventory(
        gpus=tuple(source.gpus()),
        fabrics=tuple(check_fabrics(fabrics, sys_ib)),
        cpu_threads=cpu_threads_override or cpu_threads(),
        memory_total_mb=memory_override_mb or memory_total_mb(),
        engines=tuple(installed_engines(engines, llmgw_version)),
        source=source.source_name,
    )
