"""Inventory: NVML's answers mapped through a fake of exactly the pynvml functions used (the one
hardware boundary), the inventory file, simulated GPUs, and fabrics checked against sysfs."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw.engines import EnginesConfig, VLLMConfig
from llmgw.errors import ConfigError
from llmgw.nodeagent.inventory import (
    FileGpuSource,
    NvmlGpuSource,
    SimulatedGpuSource,
    check_fabrics,
    collect_inventory,
    load_inventory_file,
    mig_index,
)
from llmgw.nodeagent.inventory.file import InventoryFile
from llmgw.protocol import FabricInfo


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """Two GPUs: an H100 with MIG enabled (two instances, slot 1 empty) and an A100."""

    NVML_DEVICE_MIG_ENABLE = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        self.gpus = [
            {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-aaa", "mem": 80 << 30, "cc": (9, 0),
             "mig": True, "ecc": 0, "pids": []},
            {"name": b"NVIDIA A100-SXM4-40GB", "uuid": b"GPU-bbb", "mem": 40 << 30, "cc": (8, 0),
             "mig": False, "ecc": 3, "pids": [4242]},
        ]  # fmt: skip
        self.migs = {
            0: [
                {
                    "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                    "uuid": "MIG-m0",
                    "mem": 40 << 30,
                    "pids": [77],
                },
                None,
                {"name": "1g.10gb", "uuid": "MIG-m2", "mem": 10 << 30, "pids": []},
            ]
        }
        self.events: list[Any] = []
        self.shutdown = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return ("gpu", i)

    def _d(self, h: Any) -> dict[str, Any]:
        if h[0] == "gpu":
            return self.gpus[h[1]]
        return self.migs[h[1]][h[2]]  # type: ignore[return-value]

    def nvmlDeviceGetName(self, h: Any) -> Any:
        return self._d(h)["name"]

    def nvmlDeviceGetUUID(self, h: Any) -> Any:
        return self._d(h)["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        return SimpleNamespace(total=self._d(h)["mem"])

    def nvmlDeviceGetCudaComputeCapability(self, h: Any) -> tuple[int, int]:
        return self._d(h)["cc"]  # type: ignore[no-any-return]

    def nvmlDeviceGetMigMode(self, h: Any) -> tuple[int, int]:
        if h[0] != "gpu":
            raise FakeNvmlError("not supported")
        on = int(self.gpus[h[1]]["mig"])
        return on, on

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        return len(self.migs.get(h[1], []))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, j: int) -> Any:
        if self.migs[h[1]][j] is None:
            raise FakeNvmlError("NVML_ERROR_NOT_FOUND")
        return ("mig", h[1], j)

    def nvmlDeviceGetTotalEccErrors(self, h: Any, kind: int, counter: int) -> int:
        if self._d(h)["name"].__class__ is bytes:
            return int(self._d(h)["ecc"])
        if self._d(h)["ecc"] == 0:
            raise FakeNvmlError("not supported")
        return int(self._d(h)["ecc"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        return [SimpleNamespace(pid=p) for p in self._d(h)["pids"]]

    def nvmlEventSetCreate(self) -> Any:
        return "events"

    def nvmlDeviceRegisterEvents(self, h: Any, kind: int, events: Any) -> None:
        pass

    def nvmlEventSetWait(self, events: Any, timeout_ms: int) -> Any:
        if not self.events:
            raise FakeNvmlError("NVML_ERROR_TIMEOUT")
        return self.events.pop(0)

    def nvmlEventSetFree(self, events: Any) -> None:
        pass


def test_nvml_mapping_gpus_mig_errors_and_pids() -> None:
    fake = FakeNvml()
    fake.events = [SimpleNamespace(device=("gpu", 1), eventData=79)] * 2
    src = NvmlGpuSource(fake)
    gpus = {g.index: g for g in src.gpus()}
    assert sorted(gpus) == [0, 1, mig_index(0, 0), mig_index(0, 2)] == [0, 1, 1000, 1002]
    h100, a100 = gpus[0], gpus[1]
    assert (h100.uuid, h100.memory_total_mb, h100.compute_capability, h100.mig_enabled) == (
        "GPU-aaa",
        80 * 1024,
        "9.0",
        True,
    )
    assert (a100.name, a100.uuid, a100.ecc_uncorrected, a100.xid_errors) == (
        "NVIDIA A100-SXM4-40GB",
        "GPU-bbb",
        3,
        2,
    )
    m0, m2 = gpus[1000], gpus[1002]
    assert (m0.uuid, m0.mig_parent_uuid, m0.gpu_class, m0.memory_total_mb) == (
        "MIG-m0",
        "GPU-aaa",
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        40 * 1024,
    )
    # A driver naming the instance by its profile alone gets the parent's name prefixed.
    assert m2.name == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    assert src.pids_on([1]) == {4242}
    assert src.pids_on([1000]) == {77}
    assert src.pids_on([0, 1002]) == set()
    src.close()
    assert fake.shutdown


def test_nvml_that_cannot_start_names_the_alternatives() -> None:
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise FakeNvmlError("NVML Shared Library Not Found")

    with pytest.raises(ConfigError, match="--sim-gpus"):
        NvmlGpuSource(Broken())


def test_inventory_file_with_mig_and_fabrics(tmp_path: Path) -> None:
    f = tmp_path / "inv.yaml"
    f.write_text(
        """
gpus:
  - {index: 0, uuid: GPU-x, name: NVIDIA H100 80GB HBM3, memory_total_mb: 81559, compute_capability: "9.0",
     mig: [{uuid: MIG-y, profile: 3g.40gb, memory_total_mb: 40192}]}
  - {index: 1, uuid: GPU-z, name: NVIDIA H100 80GB HBM3}
fabrics:
  - {name: ib0, kind: ib, hcas: [mlx5_0]}
cpu_threads: 64
"""
    )
    inv = load_inventory_file(f)
    gpus = {g.index: g for g in FileGpuSource(inv).gpus()}
    assert gpus[1000].uuid == "MIG-y" and gpus[1000].mig_parent_uuid == "GPU-x"
    assert gpus[0].mig_enabled and not gpus[1].mig_enabled
    assert inv.cpu_threads == 64 and inv.fabric_infos()[0].hcas == ("mlx5_0",)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("gpus: [{index: 0}]", "gpus.0.name"),
        ("gpus: [{index: 0, name: a}, {index: 0, name: b}]", "index 0 twice"),
        ("gpus: [{index: 0, name: a, colour: red}]", "colour"),
        ("gpus: [", "not valid YAML"),
    ],
)
def test_inventory_file_errors_name_the_entry(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "inv.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_inventory_file(f)


def test_simulated_gpus() -> None:
    gpus = SimulatedGpuSource(4, node_name="n1").gpus()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert {g.gpu_class for g in gpus} == {"sim"} and all(g.simulated for g in gpus)
    assert len({g.uuid for g in gpus}) == 4


def test_fabrics_checked_against_sysfs(tmp_path: Path) -> None:
    sys_ib = tmp_path / "infiniband"
    sys_ib.mkdir()
    (sys_ib / "mlx5_0").mkdir()
    fabrics = [
        FabricInfo(name="ib0", kind="ib", hcas=("mlx5_0",)),
        FabricInfo(name="roce", kind="roce", hcas=("mlx5_0", "mlx5_9"), gid_index=3),
    ]
    ok, bad = check_fabrics(fabrics, sys_ib)
    assert ok.present and not bad.present and "mlx5_9" in bad.problem
    # Where sysfs has no infiniband class nothing can be checked: taken as configured.
    assert all(f.present for f in check_fabrics(fabrics, tmp_path / "absent"))


def test_collect_inventory_reports_engines_and_threads() -> None:
    inv = collect_inventory(
        SimulatedGpuSource(2, node_name="n"),
        fabrics=[],
        engines=EnginesConfig(disabled=("vllm",)),
        llmgw_version="1.2.3",
        cpu_threads_override=8,
    )
    engines = {e.name: e for e in inv.engines}
    assert engines["vllm"].disabled
    assert inv.cpu_threads == 8 and inv.source == "sim" and len(inv.gpus) == 2


def _program(d: Path, name: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755)
    return p


def test_a_cpu_only_node_offers_vllm_found_on_path_or_at_its_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: a node with no GPU and a CPU build of vLLM offers vllm, as it offers
    llama.cpp: by the program on the agent's PATH, or at agent.engines.vllm.path."""
    on_path = _program(tmp_path / "bin", "vllm")
    monkeypatch.setenv("PATH", f"{on_path.parent}:/usr/bin:/bin")
    inv = collect_inventory(
        FileGpuSource(InventoryFile()), fabrics=[], engines=EnginesConfig(), llmgw_version="1"
    )
    engines = {e.name: e for e in inv.engines}
    assert inv.gpus == () and inv.cpu_threads >= 1
    assert (engines["vllm"].disabled, engines["vllm"].path) == (False, str(on_path))
    # At a path of its own, off PATH (the launcher of a virtual environment, say).
    venv = _program(tmp_path / "venv" / "bin", "vllm-launcher")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    inv = collect_inventory(
        FileGpuSource(InventoryFile()),
        fabrics=[],
        engines=EnginesConfig(vllm=VLLMConfig(path=str(venv))),
        llmgw_version="1",
    )
    assert {e.name: e for e in inv.engines}["vllm"].path == str(venv)
    # Neither: not offered.
    inv = collect_inventory(
        FileGpuSource(InventoryFile()), fabrics=[], engines=EnginesConfig(), llmgw_version="1"
    )
    if not shutil.which("vllm"):
        assert {e.name: e for e in inv.engines}["vllm"].disabled
