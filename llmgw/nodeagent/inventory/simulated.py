"""Simulated GPUs (`--sim-gpus N`): real placement, multi-GPU TP and rollouts on a laptop.

Their class is `sim`, which no real profile names, so only the simulator
engine's profiles are placed on them (and the agent's policy refuses any
other engine on them). They hold no memory and no processes.
"""

from __future__ import annotations

from llmgw.protocol import GpuDevice

__all__ = ["SIM_GPU_CLASS", "SimulatedGpuSource"]

SIM_GPU_CLASS = "sim"


class SimulatedGpuSource:
    source_name = "sim"

    def __init__(self, count: int, *, node_name: str, memory_total_mb: int = 81920) -> None:
        if count < 0:
            raise ValueError(f"--sim-gpus {count}: the number of simulated GPUs cannot be negative")
        self._gpus = [
            GpuDevice(
                index=i,
                # Stable per node, unique across nodes: placement and the control
                # plane key devices by UUID.
                uuid=f"SIM-{node_name}-{i}",
                name=SIM_GPU_CLASS,
                gpu_class=SIM_GPU_CLASS,
                memory_total_mb=memory_total_mb,
                compute_capability="9.0",
                simulated=True,
            )
            for i in range(count)
        ]

    def gpus(self) -> list[GpuDevice]:
        return list(self._gpus)

    def pids_on(self, indices: list[int]) -> set[int]:
        return set()

    def close(self) -> None:
        return None
