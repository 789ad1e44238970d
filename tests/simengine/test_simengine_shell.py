"""The asyncio shell in-process: a failing step loop turns into 503s instead of hung requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from llmgw.simengine.config import SimEngineConfig
from llmgw.simengine.engine import GenerationParams, SimEngine
from llmgw.simengine.http_app import build_app
from llmgw.simengine.timing import TimingModel


async def test_step_failure_marks_engine_dead_and_fails_waiting_requests() -> None:
    engine = SimEngine(SimEngineConfig(timing=TimingModel(time_scale=0)))
    await engine.start()
    try:
        await asyncio.wait_for(_until(lambda: engine.ready), 2)
        stream = engine.submit(GenerationParams(prompt_token_ids=(1, 2, 3), max_tokens=3))
        await asyncio.wait_for(_until(lambda: stream.done), 2)
        assert stream.num_emitted == 3

        def broken() -> None:
            raise RuntimeError("simulated scheduler bug")

        engine.scheduler.step = broken  # type: ignore[assignment, method-assign]
        doomed = engine.submit(GenerationParams(prompt_token_ids=(4, 5), max_tokens=3))
        await asyncio.wait_for(_until(lambda: doomed.aborted), 2)
        assert engine.dead
        app = build_app(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            assert (await client.get("/health")).status_code == 503
            refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503
            assert "step loop failed" in refused.json()["error"]["message"]
    finally:
        await engine.stop()


async def _until(condition: Callable[[], bool]) -> None:
    # Polling is the point: the conditions are plain attributes the engine sets, not events.
    while not condition():  # noqa: ASYNC110
        await asyncio.sleep(0.001)
