"""Benchmark: CPU cost of the simulator engine per streamed token and per request.

Spawns a real `llmgw simengine` process, drives it with N concurrent
streaming chat requests (aiohttp, in this process) and reads the engine
process's CPU time (/proc/<pid>/task/*/schedstat, all threads) before and after
the load. As a baseline measured in the same run, the same load is sent
non-streamed, so the report separates the streaming cost from the rest.

    .venv/bin/python bench/simengine.py --concurrency 256 --max-tokens 128

Prints one JSON object. Target (issue [simengine]): <= 50 us of engine CPU
per streamed token with 256 concurrent streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

TARGET_US_PER_TOKEN = 50.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """CPU seconds the process has used, all threads: schedstat's nanoseconds where available.

    /proc/<pid>/stat counts in clock ticks (10 ms), too coarse for a short run; schedstat's first
    field is the nanoseconds each thread spent on a CPU.
    """
    try:
        total_ns = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields[11], fields[12]: utime and stime (fields 14 and 15 of proc(5)), in clock ticks.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_ready(session: aiohttp.ClientSession, base: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{base}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"simengine at {base} was not ready within {deadline_s}s")


def _messages(i: int, prompt_words: int) -> list[dict[str, str]]:
    words = " ".join(f"w{(i * 7919 + j) % 1000}" for j in range(prompt_words))
    return [{"role": "user", "content": f"request {i}: {words}"}]


async def _one(
    session: aiohttp.ClientSession, base: str, i: int, args: argparse.Namespace, stream: bool
) -> int:
    body: dict[str, Any] = {
        "model": "bench",
        "messages": _messages(i, args.prompt_words),
        "max_tokens": args.max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        if not stream:
            data = await resp.json()
            return int(data["usage"]["completion_tokens"])
        tokens = 0
        usage = None
        async for line in resp.content:
            if line.startswith(b'data: {"id"') and b'"content":"' in line and b'"role"' not in line:
                tokens += 1
            elif b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
        if usage is None or usage["completion_tokens"] != tokens:
            raise RuntimeError(f"request {i}: streamed {tokens} token chunks, usage says {usage}")
        return tokens


async def _phase(base: str, args: argparse.Namespace, pid: int, stream: bool) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _wait_ready(session, base, 30)
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        counts = await asyncio.gather(
            *(_one(session, base, i, args, stream) for i in range(args.concurrency))
        )
        cpu1, t1 = _cpu_s(pid), time.monotonic()
    tokens = sum(counts)
    cpu = cpu1 - cpu0
    return {
        "requests": len(counts),
        "tokens": tokens,
        "wall_s": round(t1 - t0, 3),
        "engine_cpu_s": round(cpu, 3),
        "cpu_us_per_token": round(cpu / tokens * 1e6, 2),
        "cpu_us_per_request": round(cpu / len(counts) * 1e6, 1),
        "tokens_per_s": round(tokens / (t1 - t0), 1),
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "llmgw", "simengine",
        "--served-model-name", "bench", "--port", str(port),
        "--max-num-seqs", str(max(args.concurrency, 1)),
        "--time-scale", str(args.time_scale), "--log-level", "warning",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        # Started before the event loop does any work; a blocking Popen costs nothing measured.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220
        base = f"http://127.0.0.1:{port}"
        try:
            baseline = await _phase(base, args, proc.pid, stream=False)
            streamed = await _phase(base, args, proc.pid, stream=True)
        except Exception:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {
        "bench": "simengine",
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "time_scale": args.time_scale,
        "streamed": streamed,
        "baseline_non_streamed": baseline,
        "target_cpu_us_per_streamed_token": TARGET_US_PER_TOKEN,
        "ratio_to_target": round(streamed["cpu_us_per_token"] / TARGET_US_PER_TOKEN, 3),
        "ratio_streamed_to_non_streamed_per_token": round(
            streamed["cpu_us_per_token"] / baseline["cpu_us_per_token"], 3
        ),
        "meets_target": streamed["cpu_us_per_token"] <= TARGET_US_PER_TOKEN,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    result = asyncio.run(_main(args))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
