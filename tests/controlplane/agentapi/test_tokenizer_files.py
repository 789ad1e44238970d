"""Tokenizer files travel agent -> Postgres -> every gateway: the agent's shipper reads a ready
shard's model directory and uploads it over the real agent API; the control plane stores the
files content-addressed and NOTIFYs; two gateways' caches (two control planes) load them, and a
new version reaches both within seconds. While Postgres is down a gateway keeps the files it
loaded, and its local tokenizer keeps tokenizing with them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest

from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.local_tokens import LocalTokenizers
from llmgw.gateway.tokenizer_files import TokenizerFilesCache
from llmgw.nodeagent.client import ControlPlaneClient, Incompatible
from llmgw.nodeagent.tokenizer_ship import TokenizerShipper, read_tokenizer_files
from llmgw.protocol.tokenizers import TokenizerUpload
from llmgw.simengine.hf_tokens import tiny_model_dir
from llmgw.store.notify import NotifyHub
from tests.controlplane.agentapi.agentapi_testkit import (
    fetch,
    make_token,
    place_shard,
    running_agent_api,
)
from tests.pg_harness import PgServer
from tests.support.waiting import until

# e2e: uploaded files are tried, and tokenized, in worker processes.
pytestmark = [pytest.mark.timeout(60), pytest.mark.e2e]


async def _until(predicate, what: str, deadline_s: float = 10.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    await until(predicate, timeout_s=deadline_s, what=what, interval_s=0.01)
    return time.monotonic() - t0


async def test_tokenizer_files_reach_every_gateway_and_outlive_an_outage(
    db_url: str, pg_server: PgServer, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir() / name, model_dir / name)
    (model_dir / "model.safetensors").write_bytes(b"weights: never read")
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        other = await cp.node(await make_token(cp.sessions), "n2")
        shard = await place_shard(cp.sessions, node.id, model="tok-model")
        # Both nodes have synced (a node's shard is ready only after its agent synced).
        await cp.sync(node, seq=1)
        await cp.sync(other, seq=1)
        spec = {"profile": {"engine": "sim", "args": ["--tokenizer", str(model_dir)]}}
        # Two control planes: a LISTEN connection each.
        hubs = [NotifyHub(libpq_url(db_url), application_name=f"llmgw-test-{i}") for i in range(2)]
        gateways = [TokenizerFilesCache(cp.sessions, notify=hub, refresh_s=60.0) for hub in hubs]
        client = ControlPlaneClient(cp.base_url)
        try:
            for hub, g in zip(hubs, gateways, strict=True):
                await hub.start()
                await g.start()
                await asyncio.wait_for(g.listening.wait(), 10)

            async def upload(request: TokenizerUpload) -> None:
                await client.upload_tokenizer(request, credential=node.credential)

            # The agent's pass: the ready shard's files go up once.
            shipper = TokenizerShipper(upload)
            shipper.ready([(shard, spec)])
            assert shipper._task is not None
            await shipper._task
            want = read_tokenizer_files(model_dir).digest
            took = await _until(
                lambda: all(
                    "tok-model" in g.files and g.files["tok-model"].digest == want for g in gateways
                ),
                "both gateways load the files",
            )
            print(f"first version reached both gateways in {took * 1000:.0f} ms")
            assert set(gateways[0].files["tok-model"].files) == {
                "tokenizer.json",
                "tokenizer_config.json",
            }
            shipper.ready([(shard, spec)])
            assert shipper._task.done()  # shipped already: nothing new to do

            # A new version (another template): one more file row, the set replaced, both
            # gateways on it within seconds.
            config = json.loads((model_dir / "tokenizer_config.json").read_text())
            config["chat_template"] = "{{ messages[0]['content'] }}"
            (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
            newer = read_tokenizer_files(model_dir).digest
            second = TokenizerShipper(upload)  # a restarted agent
            second.ready([(shard, spec)])
            assert second._task is not None
            await second._task
            took = await _until(
                lambda: all(g.files["tok-model"].digest == newer for g in gateways),
                "the new version reaches both gateways",
            )
            print(f"new version reached both gateways in {took * 1000:.0f} ms")
            rows = await fetch(cp.sessions, "SELECT count(*) AS n FROM tokenizer_files")
            assert rows[0].n == 3  # tokenizer.json stored once

            # Another node cannot set this model's tokenizer.
            bad = TokenizerUpload(shard_id=shard, files={"tokenizer.json": ""})
            with pytest.raises(Incompatible, match="409"):
                await client.upload_tokenizer(bad, credential=other.credential)

            # Postgres down: the cache keeps its files, the gateway's tokenizer keeps working.
            local = LocalTokenizers()
            local.sync(gateways[0].files)
            await local.settled()
            assert local.mode("tok-model") == "local"
            held = gateways[0].files
            pg_server.allow_connections(db_url, False)
            try:
                await gateways[0]._refresh_quietly()
                assert gateways[0].failing
                assert gateways[0].files is held
                local.sync(gateways[0].files)
                got = await local.tokenize(
                    "tok-model", {"prompt": "hello world"}, chat=False, chars=11
                )
                assert isinstance(got, tuple) and got[0]
            finally:
                pg_server.allow_connections(db_url, True)
            local.close()
        finally:
            await client.close()
            for g in gateways:
                await g.stop()
            for hub in hubs:
                await hub.stop()
