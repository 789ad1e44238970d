"""Fixtures that run `llmgw simengine` as a real process on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.simengine.sim_process import SimProcess, start_sim, stop_sim
from tests.support.e2e_guard import spawns_processes


@pytest.fixture(scope="module")
@spawns_processes
def sim_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., SimProcess]]:
    started: list[SimProcess] = []
    tmp = tmp_path_factory.mktemp("simengine")

    def factory(*args: str, env: dict[str, str] | None = None) -> SimProcess:
        sim = start_sim(tmp, *args, env=env)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        stop_sim(sim)
