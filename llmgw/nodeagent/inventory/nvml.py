"""GPUs from NVML (nvidia-ml-py's `pynvml`): index, UUID, name, memory, compute capability,
MIG instances with their parent, XID and ECC error counters, and the processes on each GPU.

This is the one hardware boundary of the agent. Everything it reads goes
through the module object given to `NvmlGpuSource` (pynvml itself by
default), so tests drive the mapping with a small fake of exactly the
functions used here and nothing else is faked.

What NVML cannot answer on a given GPU (ECC on consumer cards, MIG on
pre-Ampere) is reported as zero or "not enabled", never as an agent failure:
one odd card must not keep a node from registering.
"""

from __future__ import annotations

import contextlib
from typing import Any

from llmgw.errors import ConfigError
from llmgw.logs import get_logger
from llmgw.nodeagent.inventory.base import mig_index
from llmgw.protocol import GpuDevice

__all__ = ["NvmlGpuSource"]

log = get_logger("llmgw.nodeagent.inventory")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlGpuSource:
    source_name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as e:
            raise ConfigError(
                f"NVML cannot start ({e}); on a machine without NVIDIA GPUs run the agent with "
                "--sim-gpus N or --inventory-file PATH",
                field="agent.inventory_file",
            ) from None
        self._xid: dict[int, int] = {}
        self._events: Any = None
        self._event_handles: dict[Any, int] = {}
        self._watch_xid()

    # --- XID events -------------------------------------------------------------

    def _watch_xid(self) -> None:
        n = self._nvml
        try:
            self._events = n.nvmlEventSetCreate()
        except Exception:
            self._events = None
            return
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            try:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, self._events)
                self._event_handles[h] = i
                self._xid[i] = 0
            except Exception:
                # Not supported on this GPU: its XIDs show in the kernel log only.
                continue

    def _drain_xid(self) -> None:
        if self._events is None:
            return
        n = self._nvml
        while True:
            try:
                data = n.nvmlEventSetWait(self._events, 0)
            except Exception:
                # NVML_ERROR_TIMEOUT: nothing pending.
                return
            idx = self._event_handles.get(getattr(data, "device", None))
            if idx is not None:
                self._xid[idx] = self._xid.get(idx, 0) + 1
                log.warning("gpu_xid_error", gpu=idx, xid=getattr(data, "eventData", None))

    # --- devices ----------------------------------------------------------------

    def _ecc(self, h: Any) -> int:
        n = self._nvml
        try:
            return int(
                n.nvmlDeviceGetTotalEccErrors(
                    h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
                )
            )
        except Exception:
            return 0

    def _cc(self, h: Any) -> str:
        try:
            major, minor = self._nvml.nvmlDeviceGetCudaComputeCapability(h)
            return f"{major}.{minor}"
        except Exception:
            return ""

    def _mig_enabled(self, h: Any) -> bool:
        n = self._nvml
        try:
            current, _pending = n.nvmlDeviceGetMigMode(h)
        except Exception:
            return False
        return bool(current == n.NVML_DEVICE_MIG_ENABLE)

    def _mig_handles(self, h: Any) -> list[tuple[int, Any]]:
        """(slot, handle) of each MIG instance. The slot, not the position among the
        instances that exist, numbers it: destroying one instance must not renumber the
        others, which placement and running shards refer to."""
        n = self._nvml
        out = []
        try:
            count = n.nvmlDeviceGetMaxMigDeviceCount(h)
        except Exception:
            return []
        for j in range(count):
            try:
                out.append((j, n.nvmlDeviceGetMigDeviceHandleByIndex(h, j)))
            except Exception:
                # NOT_FOUND: the slot holds no instance.
                continue
        return out

    def gpus(self) -> list[GpuDevice]:
        n = self._nvml
        self._drain_xid()
        out: list[GpuDevice] = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            name = _text(n.nvmlDeviceGetName(h))
            uuid = _text(n.nvmlDeviceGetUUID(h))
            cc = self._cc(h)
            mig = self._mig_enabled(h)
            out.append(
                GpuDevice(
                    index=i,
                    uuid=uuid,
                    name=name,
                    gpu_class=name,
                    memory_total_mb=int(n.nvmlDeviceGetMemoryInfo(h).total) >> 20,
                    compute_capability=cc,
                    mig_enabled=mig,
                    xid_errors=self._xid.get(i, 0),
                    ecc_uncorrected=self._ecc(h),
                )
            )
            if not mig:
                continue
            for slot, mh in self._mig_handles(h):
                mig_name = _text(n.nvmlDeviceGetName(mh))
                # NVML names an instance "<parent> MIG 1g.10gb" on current drivers.
                if " MIG " not in f" {mig_name} ":
                    mig_name = f"{name} MIG {mig_name}"
                out.append(
                    GpuDevice(
                        index=mig_index(i, slot),
                        uuid=_text(n.nvmlDeviceGetUUID(mh)),
                        name=mig_name,
                        gpu_class=mig_name,
                        memory_total_mb=int(n.nvmlDeviceGetMemoryInfo(mh).total) >> 20,
                        compute_capability=cc,
                        mig_parent_uuid=uuid,
                    )
                )
        return out

    def pids_on(self, indices: list[int]) -> set[int]:
        n = self._nvml
        wanted = set(indices)
        pids: set[int] = set()
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            handles = [(i, h)]
            if self._mig_enabled(h):
                handles += [(mig_index(i, slot), mh) for slot, mh in self._mig_handles(h)]
            for idx, dh in handles:
                if idx not in wanted:
                    continue
                with contextlib.suppress(Exception):
                    pids.update(int(p.pid) for p in n.nvmlDeviceGetComputeRunningProcesses(dh))
        return pids

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
