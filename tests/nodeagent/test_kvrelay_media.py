"""The KV relay's ingest thread with a medium llmgw does not know (issue 35): the frame is
applied, the unknown tier's blocks are counted in llmgw_agent_kv_unknown_medium_blocks_total
and dropped, and the warning is logged once. A real SUB bound by the relay and a PUB that
connects to it, as an engine's does; no engine process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from llmgw.kv import BlockStored, EventBatch, encode_batch
from llmgw.nodeagent.kvrelay.feed import WatchSpec
from llmgw.nodeagent.kvrelay.ingest import IngestThread
from llmgw.nodeagent.kvrelay.metrics import RelayMetrics
from tests.support.procs import agent_port_base
from tests.support.waiting import wait_for

SHARD = "s-media"


def _frames(seq: int, *events: BlockStored) -> list[bytes]:
    payload = encode_batch(EventBatch(1.0, events))
    return [f"kv@{SHARD}".encode(), seq.to_bytes(8, "big"), payload]


def test_unknown_medium_blocks_are_counted_once_each_and_warned_about_once(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    ingest = IngestThread(
        state_dir=tmp_path, metrics=RelayMetrics(registry), on_change=lambda: None
    )
    port = agent_port_base()
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)

    def counted() -> float:
        v = registry.get_sample_value(
            "llmgw_agent_kv_unknown_medium_blocks_total", {"shard": SHARD}
        )
        return v or 0.0

    def blocks() -> int:
        feed = ingest.feeds.get(SHARD)
        return feed.mirror.num_blocks if feed is not None else 0

    try:
        with capture_logs() as logs:
            ingest.start()
            ingest.command(
                "watch", WatchSpec(SHARD, port, None, "m", engine_generation=1), wait=True
            )
            pub.connect(f"tcp://127.0.0.1:{port}")
            first = _frames(
                0,
                BlockStored((1, 2, 3), None, (), 0, medium="NVME_X"),
                BlockStored((7,), None, tuple(range(16)), 16, medium="GPU"),
            )
            # Sent until the subscription has reached the PUB: a repeat of seq 0 is a
            # duplicate to the mirror, so nothing is counted twice.
            wait_for(
                lambda: pub.send_multipart(first) or counted(),
                timeout_s=10,
                what="the first batch applied",
            )
            pub.send_multipart(_frames(1, BlockStored((4,), None, (), 0, medium="NVME_X")))
            wait_for(lambda: counted() == 4, timeout_s=10, what="the second batch counted")
            assert blocks() == 1  # the GPU block; the unknown tier's are not held
            ingest.stop()
        warned = [e for e in logs if e["event"] == "kv_unknown_medium"]
        assert len(warned) == 1
        assert (warned[0]["shard"], warned[0]["medium"]) == (SHARD, "NVME_X")
    finally:
        pub.close()
        ctx.term()
        ingest.stop()
