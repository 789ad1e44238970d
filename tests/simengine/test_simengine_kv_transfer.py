"""--kv-transfer-config: its parsing, the pure block arithmetic, the scheduler's producer and
consumer sides, the cost model's transfer term and the shared-storage directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmgw.errors import ConfigError
from llmgw.kv.hashing import BlockHash, hash_block, none_hash
from llmgw.simengine.kv_storage import SharedKvStorage, check_storage_dir
from llmgw.simengine.kv_transfer import (
    KvSave,
    KvTransfer,
    block_file_name,
    leading_run,
    lookup_span,
    parse_kv_transfer_config,
    prompt_blocks_to_store,
)
from llmgw.simengine.scheduler import RequestSpec, Scheduler, SchedulerConfig, StepResult
from llmgw.simengine.timing import TimingModel

ROOT = none_hash("7")
BLOCK = 4


def _config(**fields: object) -> str:
    base: dict[str, object] = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/srv/kv"},
    }
    base.update(fields)
    return json.dumps(base)


# ---- parsing ---------------------------------------------------------------------------------


def test_a_vllm_config_parses_with_its_ignored_fields() -> None:
    raw = _config(
        kv_role="kv_producer",
        kv_rank=0,
        kv_parallel_size=2,
        kv_buffer_device="cuda",
        kv_buffer_size=1e9,
        engine_id="e-1",
        kv_ip="10.0.0.1",
        kv_port=14579,
    )
    transfer = parse_kv_transfer_config(raw)
    assert transfer == KvTransfer(role="kv_producer", storage_path="/srv/kv")
    assert transfer.is_producer and not transfer.is_consumer


@pytest.mark.parametrize(
    ("role", "producer", "consumer"),
    [("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)],
)
def test_roles(role: str, producer: bool, consumer: bool) -> None:
    transfer = parse_kv_transfer_config(_config(kv_role=role))
    assert transfer is not None
    assert (transfer.is_producer, transfer.is_consumer) == (producer, consumer)


def test_the_older_connector_name_is_accepted() -> None:
    transfer = parse_kv_transfer_config(_config(kv_connector="SharedStorageConnector"))
    assert transfer is not None and transfer.connector == "SharedStorageConnector"


@pytest.mark.parametrize("raw", [None, "", "  ", '{"kv_rank": 0}'])
def test_absent_or_connectorless_config_is_no_transfer(raw: str | None) -> None:
    assert parse_kv_transfer_config(raw) is None


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (_config(kv_rol="kv_both"), "kv_rol"),
        (_config(kv_role="kv_sender"), "kv_role"),
        (_config(kv_role=None), "no kv_role"),
        (_config(kv_connector="NixlConnector"), "'NixlConnector' is not simulated"),
        (_config(kv_connector_extra_config={}), "shared_storage_path"),
        (_config(kv_connector_extra_config={"shared_storage_path": ""}), "shared_storage_path"),
        (_config(kv_connector_extra_config={"shared_storage_path": 3}), "shared_storage_path"),
        (
            _config(kv_connector_extra_config={"shared_storage_path": "/x", "pth": 1}),
            "unknown keys ['pth']",
        ),
        ('{"kv_role": "kv_both"}', "no kv_connector"),
        ("[1]", "JSON list; pass an object"),
        ("{kv_role", "is not JSON"),
    ],
)
def test_bad_configs_are_refused_naming_the_fix(raw: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_kv_transfer_config(raw)
    assert says in info.value.message and "--kv-transfer-config" in info.value.message


# ---- pure block arithmetic -------------------------------------------------------------------


def test_a_producer_stores_every_full_prompt_block() -> None:
    assert [prompt_blocks_to_store(n, BLOCK) for n in (3, 4, 7, 8, 9)] == [0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("local", "prompt", "tokens", "span"),
    [
        (0, 12, 12, (0, 2)),  # the block holding the last token is computed, not loaded
        (0, 13, 13, (0, 3)),
        (2, 13, 13, (2, 3)),  # the local hit is never loaded again
        (3, 13, 13, (3, 3)),
        (0, 3, 3, (0, 0)),  # no full block
        (0, 12, 20, (0, 3)),  # preempted with output: every prompt block, no output block
    ],
)
def test_lookup_span(local: int, prompt: int, tokens: int, span: tuple[int, int]) -> None:
    assert lookup_span(local, prompt, tokens, BLOCK) == span


def test_leading_run_stops_at_the_first_gap() -> None:
    hashes = [BlockHash(bytes([i]) * 32) for i in range(4)]
    held = {hashes[0], hashes[1], hashes[3]}
    assert leading_run(hashes, held.__contains__) == 2
    assert leading_run(hashes[2:], held.__contains__) == 0
    assert leading_run([], held.__contains__) == 0


# ---- the scheduler's two sides ---------------------------------------------------------------


def _hasher(parent: BlockHash | None, tokens: tuple[int, ...], index: int) -> BlockHash:
    return hash_block(ROOT if parent is None else parent, tokens, None)


def _spec(rid: str, prompt: range, num_out: int) -> RequestSpec:
    return RequestSpec(rid, tuple(prompt), tuple(range(90_000, 90_000 + num_out)), _hasher)


def _drain(s: Scheduler) -> list[StepResult]:
    out: list[StepResult] = []
    while s.has_work():
        out.append(s.step())
    return out


def _sched(**kw: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64),
        **kw,  # type: ignore[arg-type]
    )


def test_a_producer_reports_its_prompt_blocks_once_when_the_prefill_completes() -> None:
    s = _sched(kv_save=True)
    s.add_request(_spec("a", range(1, 15), 3))  # 14 tokens: 3 full blocks
    results = _drain(s)
    saves = [save for r in results for save in r.kv_saves]
    assert len(saves) == 1 and saves[0].block_size == BLOCK
    assert saves[0].token_ids == tuple(range(1, 13))
    expected: list[BlockHash] = []
    for i in range(3):
        expected.append(
            _hasher(expected[-1] if expected else None, tuple(range(1 + 4 * i, 5 + 4 * i)), i)
        )
    assert saves[0].block_hashes == tuple(expected)
    assert list(results[0].kv_saves) == saves  # the step that computed the prompt reports it


def test_a_scheduler_without_kv_save_reports_nothing() -> None:
    s = _sched()
    s.add_request(_spec("a", range(1, 15), 2))
    assert all(not r.kv_saves for r in _drain(s))


def test_a_consumer_loads_found_blocks_as_cached_not_as_prefill() -> None:
    producer = _sched(kv_save=True)
    producer.add_request(_spec("p", range(1, 18), 1))  # 17 tokens: 4 full blocks
    (save,) = [sv for r in _drain(producer) for sv in r.kv_saves]
    store = set(save.block_hashes)
    asked: list[int] = []

    def lookup(hashes: object) -> int:
        seq = list(hashes)  # type: ignore[call-overload]
        asked.append(len(seq))
        return leading_run(seq, store.__contains__)

    consumer = _sched(kv_lookup=lookup)
    consumer.add_request(_spec("c", range(1, 18), 3))
    first = consumer.step()
    # 4 blocks (16 tokens) loaded; the 17th token is computed and yields the first output.
    assert first.admitted == (("c", 16),)
    assert first.num_loaded_tokens == 16 and first.num_prefill_tokens == 1
    assert first.prefix_hits == 0 and first.external_queries == 17
    assert consumer.num_cached_tokens("c") == 16
    assert first.emitted == ("c",)
    # The loaded blocks are now the consumer's own cache: the next request hits them locally.
    _drain(consumer)
    consumer.add_request(_spec("d", range(1, 18), 1))
    again = consumer.step()
    assert again.admitted == (("d", 16),) and again.prefix_hits == 16
    assert again.num_loaded_tokens == 0
    assert asked == [4]  # nothing past the local hit is left to ask for


def test_a_consumer_stops_at_the_first_missing_block_and_computes_the_rest() -> None:
    held = {_hasher(None, (1, 2, 3, 4), 0)}
    consumer = _sched(kv_lookup=lambda hashes: leading_run(hashes, held.__contains__))
    consumer.add_request(_spec("c", range(1, 18), 1))
    first = consumer.step()
    assert first.admitted == (("c", 4),)
    assert first.num_loaded_tokens == 4 and first.num_prefill_tokens == 13


def test_an_unknown_prompt_on_a_consumer_gets_nothing() -> None:
    consumer = _sched(kv_lookup=lambda hashes: 0)
    consumer.add_request(_spec("c", range(100, 117), 1))
    first = consumer.step()
    assert first.admitted == (("c", 0),) and first.num_loaded_tokens == 0
    assert first.num_prefill_tokens == 17 and first.external_queries == 17


def test_a_lookup_claiming_more_than_asked_is_capped() -> None:
    consumer = _sched(kv_lookup=lambda hashes: 99)
    consumer.add_request(_spec("c", range(1, 10), 1))  # 9 tokens: 2 blocks may be loaded
    assert consumer.step().num_loaded_tokens == 8


def test_loaded_blocks_take_cache_blocks_and_wait_for_room() -> None:
    # 6 usable blocks; a 17-token prompt needs 5 (4 loaded + 1 computed) plus one to decode.
    s = Scheduler(
        SchedulerConfig(num_blocks=7, block_size=BLOCK, max_num_batched_tokens=64),
        kv_lookup=lambda hashes: len(hashes),
    )
    s.add_request(_spec("a", range(200, 213), 3))  # 13 tokens, 4 blocks once decoding
    s.add_request(_spec("c", range(1, 18), 2))
    results = _drain(s)
    assert [r.num_loaded_tokens for r in results if r.num_loaded_tokens] == [12, 16]
    a_done = next(i for i, r in enumerate(results) if "a" in r.finished)
    c_in = next(i for i, r in enumerate(results) if r.admitted and r.admitted[0][0] == "c")
    assert c_in > a_done  # 5 blocks did not fit beside a's 4 of 6
    assert s.pool.num_free_blocks == 6


# ---- cost model ------------------------------------------------------------------------------


def test_loaded_tokens_cost_the_transfer_not_prefill() -> None:
    t = TimingModel(step_overhead_ms=1.0, prefill_ms_per_token=0.1, kv_load_ms_per_token=0.01)
    assert t.step_duration_s(1, 0, 1000) == pytest.approx((1.0 + 0.1 + 10.0) / 1000)
    assert t.step_duration_s(1, 0) == pytest.approx(1.1 / 1000)
    assert TimingModel().kv_load_ms_per_token == 0.005
    with pytest.raises(ConfigError, match="kv_load_ms_per_token"):
        TimingModel(kv_load_ms_per_token=-1)


# ---- the shared-storage directory ------------------------------------------------------------


def test_storage_writes_one_file_per_block_atomically_and_finds_runs(tmp_path: Path) -> None:
    transfer = KvTransfer(role="kv_both", storage_path=str(tmp_path))
    storage = SharedKvStorage(transfer)
    h0 = _hasher(None, (1, 2, 3, 4), 0)
    h1 = _hasher(h0, (5, 6, 7, 8), 1)
    save = KvSave((h0, h1), (1, 2, 3, 4, 5, 6, 7, 8), BLOCK)
    assert storage.save([save]) == 2
    assert storage.save([save]) == 0  # stored already
    assert sorted(os.listdir(tmp_path)) == sorted([block_file_name(h0), block_file_name(h1)])
    body = json.loads((tmp_path / block_file_name(h1)).read_text())
    assert body == {"parent": bytes(h0).hex(), "token_ids": [5, 6, 7, 8]}
    assert storage.leading_run([h0, h1, BlockHash(b"\0" * 32)]) == 2
    (tmp_path / block_file_name(h0)).unlink()
    assert storage.leading_run([h0, h1]) == 0


def test_a_missing_storage_dir_is_refused_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=str(missing)) as info:
        check_storage_dir(KvTransfer(role="kv_consumer", storage_path=str(missing)))
    assert "create it" in info.value.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes any directory")
def test_an_unwritable_storage_dir_is_refused_for_a_producer_only(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        check_storage_dir(KvTransfer(role="kv_consumer", storage_path=str(tmp_path)))
        with pytest.raises(ConfigError, match="not readable and writable"):
            check_storage_dir(KvTransfer(role="kv_producer", storage_path=str(tmp_path)))
    finally:
        tmp_path.chmod(0o700)
