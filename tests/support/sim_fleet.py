"""A simulated fleet's rows, shared by the reconcile shell's tests and bench/reconcile.py: the
fields of a sim profile (what ``check_profile`` fingerprints), a node's simulated inventory as
node_status stores it, and the SQL statements a pass sends, counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["counted_statements", "sim_inventory", "sim_profile_fields"]

_SIM_PROFILE: dict[str, Any] = {
    "engine": "sim",
    "gpu_class": "sim",
    "tp": 1,
    "pp": 1,
    "gpus_per_node": 0,
    "nodes": 1,
    "model_path": "sim-model",
    "served_model_name": "",
    "args": [],
    "env": {},
    "secret_env": {},
    "adapters": [],
    "kv_events": False,
    "adapter_slots": 0,
    "threads": 0,
    "kv_hash_seed": "4242",
    "kv_block_size": 16,
    "kv_hash_algo": "sha256_cbor",
    "kv_extra_key_format": "tagged",
}


def sim_profile_fields(**overrides: Any) -> dict[str, Any]:
    """Every field of a sim profile (model path ``sim-model``, seed ``4242``), ``overrides``
    applied; the rows a caller inserts must say the same."""
    unknown = overrides.keys() - _SIM_PROFILE.keys()
    assert not unknown, f"not a profile field: {sorted(unknown)}"
    return dict(_SIM_PROFILE, **overrides)


def sim_inventory(num_gpus: int, *, cpu_threads: int = 8) -> str:
    """A node's inventory JSON: ``num_gpus`` simulated GPUs of class sim (uuids SIM-0 ...)."""
    gpus = [
        {"index": i, "uuid": f"SIM-{i}", "name": "sim", "gpu_class": "sim", "simulated": True}
        for i in range(num_gpus)
    ]
    return json.dumps({"gpus": gpus, "cpu_threads": cpu_threads, "source": "sim"})


@contextmanager
def counted_statements(engine: AsyncEngine) -> Iterator[list[str]]:
    """The SQL statements ``engine`` sends while the block runs, appended as they go."""
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)
