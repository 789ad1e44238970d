"""The GPU-source interface every inventory implementation provides."""

from __future__ import annotations

from typing import Protocol

from llmgw.protocol import GpuDevice

__all__ = ["GpuSource", "mig_index"]


def mig_index(parent_index: int, slot: int) -> int:
    """The index placement uses for the MIG instance in NVML slot `slot` of GPU `parent_index`.

    CUDA gives an instance no index (only MIG-<uuid> addresses it), and
    placement needs one number per placeable device that never collides
    with a GPU's: 1000 and up, as the seed fixed it, 100 slots per GPU
    (7 instances is the most any GPU carves).
    """
    return 1000 + parent_index * 100 + slot


class GpuSource(Protocol):
    """Where the node's GPUs come from."""

    # "nvml", "file" or "sim": reported in the inventory.
    source_name: str

    def gpus(self) -> list[GpuDevice]:
        """Every GPU and MIG instance, with current error counters."""
        ...

    def pids_on(self, indices: list[int]) -> set[int]:
        """Processes holding the GPUs (or MIG instances) with these indices now."""
        ...

    def close(self) -> None: ...
